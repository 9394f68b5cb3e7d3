"""Hostile configs and command lines (SPEC M13): a clear error naming the key or flag, or a
run that keeps its promise; never a crash, and never a run that delivers nothing with rc 0."""

import json
import subprocess
import sys

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient


def two_streams(tmp_path, wa, wb, **over):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(6, max_bytes=1500))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(6, start=30, max_bytes=1500))
    return {"seq_len": 64, "global_batch_size": 2, "shuffle": {"window": 2},
            "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")], "weight": wa},
                        "b": {"paths": [str(tmp_path / "b.jsonl")], "weight": wb}}} | over  # fmt: skip


def test_weights_whose_sum_overflows_mix_like_equal_weights(tmp_path):
    huge = StepFeed(parse_config(two_streams(tmp_path, 1e308, 1e308)), executor=iter_blocks_local)
    equal = StepFeed(parse_config(two_streams(tmp_path, 1, 1)), executor=iter_blocks_local)
    try:
        for _ in range(5):
            assert huge.next_step().equals(equal.next_step())
        assert huge.mixer.scheduled_weights(0).tolist() == [0.5, 0.5]
    finally:
        huge.close()
        equal.close()


@pytest.mark.parametrize("weight", [10**400, -(10**400)])
def test_a_400_digit_weight_is_a_config_error_naming_the_stream(tmp_path, weight):
    with pytest.raises(ConfigError, match="streams.a.weight"):
        parse_config(two_streams(tmp_path, weight, 1))


def test_a_schedule_weight_that_overflows_is_named(tmp_path):
    raw = two_streams(tmp_path, 1, 1, schedule=[{"step": 3, "weights": {"a": 10**400, "b": 1}}])
    with pytest.raises(ConfigError, match="schedule.0.weights"):
        parse_config(raw)


def tokenmill(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "service", *args], capture_output=True,
                          text=True, timeout=patient(300), cwd=tmp_path)  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--world-size", "-2"], "--world-size must be >= 1, got -2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--state-every", "-1"], "--state-every must be >= 0"),
    ],
)
def test_bad_export_flags_are_refused(tmp_path, flags, message):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(two_streams(tmp_path, 1, 1)))
    r = tokenmill(tmp_path, "export", "--config", "c.yaml", "--out", "o", "--local", *flags)
    assert r.returncode == 2 and message in r.stderr and not (tmp_path / "o").exists()


def test_an_out_of_vocabulary_eos_is_refused_before_anything_is_written(tmp_path):
    raw = two_streams(tmp_path, 1, 1, tokenizer={"eos_id": 2_000_000_000, "add_eos": True})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    r = tokenmill(tmp_path, "export", "--config", "c.yaml", "--out", "o", "--local", "--steps", "2")
    assert r.returncode == 1 and "tokenizer.eos_id: 2000000000 is not an id" in r.stderr
    assert not list((tmp_path / "o").glob("step-*"))


def test_a_run_that_delivers_nothing_exits_non_zero(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": ""}\n{"nope": 1}\nnot json\n')
    raw = {"seq_len": 64, "global_batch_size": 2, "on_error": "skip",
           "streams": {"a": {"paths": [str(tmp_path / "bad.jsonl")]}}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    r = tokenmill(tmp_path, "export", "--config", "c.yaml", "--out", "o", "--local")
    assert r.returncode == 1 and "delivered nothing" in r.stderr
    rejects = [json.loads(x) for x in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert [x["record"] for x in rejects] == [0, 1, 2]
