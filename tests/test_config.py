import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.read.resolve import load_config, parse_config


def _cfg(tmp_path, **over):
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    base = {"seq_len": 64, "streams": {"web": {"paths": [str(tmp_path / "d.jsonl")]}}}
    base.update(over)
    return base


def test_minimal_config_resolves_paths_and_format(tmp_path):
    cfg = parse_config(_cfg(tmp_path))
    assert cfg.streams["web"].format == "jsonl"
    assert cfg.streams["web"].paths == [str(tmp_path / "d.jsonl")]
    assert cfg.weights == {"web": 1.0}


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"seq_len": 4}, ["seq_len", "4"]),
        ({"bogus": 1}, ["bogus", "unknown key"]),
        ({"streams": {}}, ["streams", "at least one"]),
        ({"packing": {"mode": "zigzag"}}, ["packing.mode", "zigzag"]),
        ({"on_error": "ignore"}, ["on_error", "ignore"]),
        ({"global_batch_size": 0}, ["global_batch_size"]),
    ],
)
def test_invalid_values_name_key_and_value(tmp_path, override, names):
    with pytest.raises(ConfigError) as e:
        parse_config(_cfg(tmp_path, **override))
    for n in names:
        assert n in str(e.value)


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf")])
def test_non_positive_weight(tmp_path, weight):
    data = _cfg(tmp_path)
    data["streams"]["web"]["weight"] = weight
    with pytest.raises(ConfigError, match=r"streams\.web\.weight"):
        parse_config(data)


def test_unknown_stream_key(tmp_path):
    data = _cfg(tmp_path)
    data["streams"]["web"]["txt_field"] = "x"
    with pytest.raises(ConfigError, match=r"streams\.web\.txt_field: unknown key"):
        parse_config(data)


def test_path_matching_nothing_names_stream_and_pattern(tmp_path):
    data = _cfg(tmp_path)
    data["streams"]["web"]["paths"] = [str(tmp_path / "nope" / "*.jsonl")]
    with pytest.raises(ConfigError, match=r"streams\.web\.paths: .*nope.* matches no files"):
        parse_config(data)


def test_schedule_names_unknown_stream(tmp_path):
    with pytest.raises(ConfigError, match=r"schedule\.0\.weights: unknown stream 'nope'"):
        parse_config(_cfg(tmp_path, schedule=[{"step": 3, "weights": {"nope": 1}}]))


def test_globs_dirs_urls_sorted_and_deduplicated(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    for name in ["b.jsonl", "a.jsonl", "sub/c.jsonl"]:
        (d / name).write_text('{"text": "x"}\n')
    (d / ".hidden.jsonl").write_text("junk\n")
    data = {"streams": {"s": {"paths": [str(d / "*.jsonl"), str(d), f"file://{d}/a.jsonl"]}}}
    files = parse_config(data).streams["s"].paths
    assert [f.rsplit("/", 1)[-1] for f in files] == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_relative_paths_resolve_against_config_dir(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"streams": {"s": {"paths": ["d.jsonl"]}}}))
    monkeypatch.chdir("/")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.streams["s"].paths == [str(tmp_path / "d.jsonl")]


def test_mixed_extensions_need_a_format(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match="set 'format'"):
        parse_config({"streams": {"s": {"paths": [str(tmp_path)]}}})


def test_config_hash_is_stable_and_sensitive(tmp_path):
    a = parse_config(_cfg(tmp_path))
    b = parse_config(_cfg(tmp_path))
    c = parse_config(_cfg(tmp_path, seed=7))
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_bad_yaml_is_a_config_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("streams: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)


def test_a_relative_tokenizer_path_resolves_next_to_the_config(tmp_path, monkeypatch):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    data = {"tokenizer": {"name": "tok/tokenizer.json"}, "streams": {"s": {"paths": ["d.jsonl"]}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir("/")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.tokenizer.name == str(tmp_path / "tok" / "tokenizer.json")
    # A name that is no path here stays a Hub name; 'default' stays 'default'.
    data["tokenizer"]["name"] = "org/model"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    assert load_config(tmp_path / "c.yaml").tokenizer.name == "org/model"


@pytest.mark.parametrize(
    "seq_len, batch, lanes, service, window",
    [
        (2048, 32, 1, {}, 32),  # 256 KB a step: WINDOW_STEPS steps
        (2048, 32, 2, {}, 64),  # the lanes hold the rows: LOOKAHEAD steps
        (2048, 32, 16, {}, 64),
        (8192, 512, 1, {}, 16),  # 16 MB a step: 256 MB of ids
        (8192, 512, 4, {}, 16),  # held by the lanes, the same bound
        (8192, 1024, 1, {}, 8),  # 32 MB a step: never fewer than 8
        (2048, 32, 1, {"prefetch": 4}, 4),  # the config's own
        (2048, 32, 2, {"prefetch": 4}, 4),
    ],
)
def test_the_service_window(tmp_path, seq_len, batch, lanes, service, window):
    """How many steps the batch server may make ahead of the slowest rank (the window a
    rank's answer of up to LOOKAHEAD steps is taken from)."""
    from service.batch_server import prefetch_window

    cfg = parse_config(_cfg(tmp_path, seq_len=seq_len, global_batch_size=batch, lanes=lanes,
                            service=service))  # fmt: skip
    assert prefetch_window(cfg) == window
    assert cfg.config_hash() == parse_config(_cfg(tmp_path, seq_len=seq_len, lanes=lanes,
                                                  global_batch_size=batch)).config_hash()  # fmt: skip


def test_a_service_window_below_one_step_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="prefetch"):
        parse_config(_cfg(tmp_path, service={"prefetch": 0}))
