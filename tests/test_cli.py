"""The command line a new user meets: help texts, `check`, and runs that deliver nothing."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from service.cli import build_parser, main
from tests.conftest import stdlib_texts, write_jsonl


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_flag_has_help_and_shows_its_default():
    for name, sub in _subparsers(build_parser()).items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0]
            assert action.help, f"tokenmill {name} {flag} has no help text"
            if not action.required:
                assert f"(default: {action.default})" in " ".join(text.split()), (name, flag)


def _config(tmp_path, streams: dict, **extra) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 2, **extra,
                                    "packing": {"mode": "concat"}, "streams": streams}))  # fmt: skip
    return str(path)


def _bad_jsonl(path, n: int):
    path.write_text("".join(f'{{"txt": "no text field {i}"}}\n' for i in range(n)))
    return path


def test_check_lists_the_first_bad_records_and_counts_them_all(tmp_path, capsys):
    _bad_jsonl(tmp_path / "bad.jsonl", 7)
    write_jsonl(tmp_path / "good.jsonl", stdlib_texts(3))
    cfg = _config(tmp_path, {"b": {"paths": ["bad.jsonl"]}, "g": {"paths": ["good.jsonl"]}})
    assert main(["check", "--config", cfg, "--show", "3"]) == 1
    out, err = capsys.readouterr()
    assert "tokenizer ok:" in out
    listed = [ln for ln in out.splitlines() if ln.startswith("BAD b:")]
    assert len(listed) == 3 and "bad.jsonl:0" in listed[0]
    assert "b: 7 bad record(s) (4 not listed)" in err
    assert "g:" not in err


def test_check_loads_the_tokenizer(tmp_path, capsys):
    write_jsonl(tmp_path / "good.jsonl", stdlib_texts(2))
    (tmp_path / "broken.json").write_text("{not json")
    cfg = _config(tmp_path, {"g": {"paths": ["good.jsonl"]}}, tokenizer={"name": "broken.json"})
    assert main(["check", "--config", cfg]) == 1
    assert "BAD tokenizer" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("on_exhausted", ["stop", "renormalize"])
def test_an_all_rejected_stream_fails_the_export(tmp_path, capsys, on_exhausted):
    """One stream is entirely bad records: whether the run stops at once (0 steps) or carries
    on with the other stream, it must not exit 0."""
    _bad_jsonl(tmp_path / "bad.jsonl", 5)
    write_jsonl(tmp_path / "good.jsonl", stdlib_texts(20))
    cfg = _config(
        tmp_path, {"b": {"paths": ["bad.jsonl"]}, "g": {"paths": ["good.jsonl"]}},
        mixing={"on_exhausted": on_exhausted},
    )  # fmt: skip
    out = tmp_path / "o"
    assert main(["export", "--config", cfg, "--out", str(out), "--steps", "2", "--local"]) == 1
    err = capsys.readouterr().err
    assert f"stream 'b' delivered nothing: all 5 record(s) read were rejected (see {out}" in err, (
        err
    )
    rejects = (out / "rejects.jsonl").read_text().splitlines()
    assert len(rejects) == 5 and json.loads(rejects[0])["stream"] == "b"


def test_an_all_rejected_repeated_stream_ends_after_one_epoch(tmp_path, capsys):
    """`repeat: 1000` over records that are all rejected: the stream ends after its first
    epoch (every epoch holds the same records), each record is rejected once, and the run
    still fails by name; the good stream carries on (renormalize)."""
    _bad_jsonl(tmp_path / "bad.jsonl", 5)
    write_jsonl(tmp_path / "good.jsonl", stdlib_texts(20))
    cfg = _config(
        tmp_path, {"b": {"paths": ["bad.jsonl"], "repeat": 1000}, "g": {"paths": ["good.jsonl"]}},
        mixing={"on_exhausted": "renormalize"},
    )  # fmt: skip
    out = tmp_path / "o"
    assert main(["export", "--config", cfg, "--out", str(out), "--steps", "2", "--local"]) == 1
    err = capsys.readouterr().err
    assert "stream 'b' delivered nothing: all 5 record(s) read were rejected" in err, err
    assert len((out / "rejects.jsonl").read_text().splitlines()) == 5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["streams"]["b"]["epochs_started"] == 1, summary["streams"]["b"]


def test_a_clean_export_exits_0(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", stdlib_texts(20))
    cfg = _config(tmp_path, {"g": {"paths": ["good.jsonl"]}})
    assert (
        main(["export", "--config", cfg, "--out", str(tmp_path / "o"), "--steps", "2", "--local"])
        == 0
    )


def test_check_finds_token_ids_outside_the_vocabulary(tmp_path, capsys):
    """`check` loads the tokenizer, so it rejects what the export would: an id it lacks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [[1, 2, 3], [5, 200_000], [7]]
    pq.write_table(
        pa.table({"tokens": pa.array(ids, pa.list_(pa.int32()))}), tmp_path / "t.parquet"
    )
    cfg = _config(tmp_path, {"t": {"paths": ["t.parquet"], "tokens_field": "tokens"}})
    assert main(["check", "--config", cfg]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("BAD t:")]
    assert "t.parquet:1" in line and "token id 200000 is outside the tokenizer's vocabulary" in line


def test_check_names_the_lane_whose_share_costs_most_bytes_per_token(tmp_path, capsys):
    """With lanes, `check` gives each lane's bytes read per token served: the lane whose share
    holds the most is the one all lanes wait for. One 12 kB document of long blank runs (many
    bytes a token) is the largest piece, so it is lane 0's whole share; twelve 1 kB documents
    of numbers (few bytes a token) are lane 1's."""
    from pipeline.inspect.stats import count_corpus, lane_pace
    from pipeline.read.resolve import load_config

    sparse = "".join(f"word{i}" + " " * 120 + "\n" for i in range(96))[:12_000]
    dense = [" ".join(str(i * j % 997) for j in range(250))[:1000] for i in range(12)]
    write_jsonl(tmp_path / "a_sparse.jsonl", [sparse])
    write_jsonl(tmp_path / "b_dense.jsonl", dense)
    cfg = _config(tmp_path, {"s": {"paths": ["a_sparse.jsonl", "b_dense.jsonl"]}}, lanes=2,
                  shuffle={"piece_bytes": 4096}, read={"first_block_bytes": 4096})  # fmt: skip
    counts = count_corpus(load_config(cfg), lambda r: None)
    whole = count_corpus(load_config(cfg).model_copy(update={"lanes": 1}), lambda r: None)
    (lanes,) = [c.lanes for c in counts.values()]
    assert sum(t for _, t in lanes) == whole["s"].tokens == counts["s"].tokens
    assert sum(b for b, _ in lanes) == sum((tmp_path / f).stat().st_size
                                           for f in ("a_sparse.jsonl", "b_dense.jsonl"))  # fmt: skip
    pace = lane_pace(load_config(cfg), counts)
    assert pace is not None and pace[0] > 4 * pace[1], pace
    assert main(["check", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert f"{pace[1]:.2f} (lane 1) to {pace[0]:.2f} (lane 0)" in out
    assert "expect lane 0 to be the slowest" in out


def test_bench_runs_the_checkouts_benchmarks_in_a_process_of_their_own(capfd):
    """`tokenmill bench [e2e]` is `python -m bench [e2e]`; the product never imports bench/."""
    import ast
    from pathlib import Path

    assert main(["bench", "e2e", "--help"]) == 0
    assert "usage: tokenmill bench e2e" in capfd.readouterr().out
    root = Path(__file__).resolve().parents[1]
    for path in [*root.glob("pipeline/**/*.py"), *root.glob("service/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "bench" for n in names), path


def test_bench_without_a_checkout_says_where_to_run_it(tmp_path, monkeypatch, capsys):
    import service.cli

    monkeypatch.setattr(service.cli, "__file__", str(tmp_path / "service" / "cli.py"))
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "source checkout (bench/)" in err and "./dev bench" in err


def test_help_names_nothing_users_do_not_have():
    """Help texts refer to no internal document ("SPEC §3.1"): users have only the docs."""
    texts = [build_parser().format_help()]
    texts += [sub.format_help() for sub in _subparsers(build_parser()).values()]
    for text in texts:
        assert "SPEC" not in text and "§" not in text, text


def _token_docs(path, docs: int, length: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [[7] * length for _ in range(docs)]
    pq.write_table(pa.table({"tokens": pa.array(ids, pa.list_(pa.int32()))}), path)


@pytest.mark.parametrize("on_exhausted", ["stop", "renormalize"])
def test_check_counts_records_tokens_and_the_steps_they_make(tmp_path, capsys, on_exhausted):
    """Stream a: 40 documents of 100 tokens (99 ids + EOS) at weight 0.5; b: 20 of them at
    0.5, read 3 times. 2 rows x 64 tokens = 128 a step, 64 of each stream: a's pass lasts
    4000/64 = 62 steps, b's 2000/64 = 31 (the epoch); over the run a runs dry first (62
    steps), or, renormalized, every token is used: 10000/128 = 78 steps. A real export of
    the data writes that many steps."""
    _token_docs(tmp_path / "a.parquet", 40, 99)
    _token_docs(tmp_path / "b.parquet", 20, 99)
    cfg = _config(tmp_path, {"a": {"paths": ["a.parquet"], "tokens_field": "tokens", "weight": 0.5},
                             "b": {"paths": ["b.parquet"], "tokens_field": "tokens", "weight": 0.5,
                                   "repeat": 3}},
                  mixing={"on_exhausted": on_exhausted})  # fmt: skip
    assert main(["check", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "a: 40 records, 40 ok, 0 bad; 4,000 tokens in one pass" in out
    assert "b: 20 records, 20 ok, 0 bad; 2,000 tokens in one pass" in out
    assert "2 rows x 64 tokens = 128 tokens a step" in out
    assert "a: one pass lasts 62 steps" in out and "b: one pass lasts 31 steps" in out
    assert "one epoch (until the first stream, 'b', has been read once): 31 steps" in out
    run = 62 if on_exhausted == "stop" else 78
    assert f"the whole run (repeat: a x1, b x3): {run} steps" in out
    assert "all 60 records ok (6,000 tokens)" in out
    o = tmp_path / "o"
    assert main(["export", "--config", cfg, "--out", str(o), "--local"]) == 0
    assert abs(json.loads((o / "summary.json").read_text())["steps"] - run) <= 1


def test_check_counts_bad_records_beside_the_good(tmp_path, capsys):
    _bad_jsonl(tmp_path / "bad.jsonl", 2)
    write_jsonl(tmp_path / "good.jsonl", stdlib_texts(3))
    with open(tmp_path / "bad.jsonl", "a") as f:
        f.write(json.dumps({"text": "fine"}) + "\n")
    cfg = _config(tmp_path, {"b": {"paths": ["bad.jsonl"]}, "g": {"paths": ["good.jsonl"]}})
    assert main(["check", "--config", cfg]) == 1
    out = capsys.readouterr().out
    assert "b: 3 records, 1 ok, 2 bad; 2 tokens in one pass" in out  # "fine" + EOS
    assert "g: 3 records, 3 ok, 0 bad" in out and "all" not in out.splitlines()[-1]


def test_the_readmes_records_are_good_records(tmp_path, capsys):
    """The README's pretrain and chat (OpenAI `messages`) records pass `check` as shown."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    records = [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", readme, re.S)]
    chat = [r for r in records if "messages" in r]
    text = [r for r in records if "text" in r]
    assert chat and text
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    cfg = _config(tmp_path, {"c": {"kind": "chat", "paths": ["chat.jsonl"]},
                             "t": {"paths": ["text.jsonl"]}})  # fmt: skip
    assert main(["check", "--config", cfg]) == 0
    assert f"all {len(records)} records ok" in capsys.readouterr().out


def test_the_readmes_resume_keeps_the_world_size():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    exports = [ln for ln in readme.splitlines() if ln.startswith("tokenmill export")]
    sizes = [re.search(r"--world-size (\d+)", ln) for ln in exports]
    assert any("--resume" in ln for ln in exports) and all(sizes), exports
    assert len({m.group(1) for m in sizes if m}) == 1
