"""The end of the data ends nothing early: with `repeat: 1`, HF's Trainer (through FeedTrainer)
and our torchrun trainer each train on every step the data makes, then stop and exit 0,
however many steps they were asked for."""

import json
import os
import time

import pytest
import ray

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient
from tests.test_adapters import LENGTH, hf_run
from tests.test_trainer_service import torchrun

pytestmark = pytest.mark.slow


@pytest.fixture
def short_service(ray_cluster, tmp_path):
    """A service whose one stream is read once (`repeat: 1`): a handful of steps, then the end."""
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(6, max_bytes=700))
    actors = []

    def make(name: str, G: int):
        cfg = parse_config({"seed": 5, "seq_len": LENGTH, "global_batch_size": G,
                            "shuffle": {"window": 4},
                            "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")], "repeat": 1}}})  # fmt: skip
        actors.append(start_server(cfg, name=f"{name}{os.getpid()}", prefetch=4))
        return f"{name}{os.getpid()}", actors[-1]

    yield make
    for a in actors:
        ray_cluster.kill(a)


def produced_all(actor) -> int:
    st = ray.get(actor.status.remote())
    assert st["producer"] == "ended" and st["drained"], st
    return st["global_step"]


def test_hf_trainer_trains_on_every_step_then_stops(short_service, tmp_path):
    service, actor = short_service("hf-end", 2)
    seen, losses, trainer = hf_run(service, tmp_path / "hf", max_steps=1000)
    total = produced_all(actor)
    assert 4 <= total < 100
    assert len(seen) == total  # one micro-batch per global step (world 1), none left out
    assert trainer.state.global_step == total // 2  # gradient_accumulation_steps=2


def test_torchrun_trainer_trains_on_every_step_then_exits_0(ray_cluster, short_service, tmp_path):
    service, actor = short_service("tr-end", 4)
    out = torchrun(ray_cluster, 2, service, "--steps", "1000",
                   "--log-json", str(tmp_path / "log.jsonl"))  # fmt: skip
    total = produced_all(actor)
    summary = json.loads(next(x for x in out.splitlines() if x.startswith('{"summary"')))["summary"]
    assert summary["steps"] == total >= 4  # grad_accum 1: one optimizer step per global step
    # Both ranks reported their loss per stream for every step (fire and forget: allow a beat).
    deadline = time.time() + patient(10)
    while len(ray.get(actor.metrics.remote())["stream_loss"]["history"]) < total:
        assert time.time() < deadline, ray.get(actor.metrics.remote())["stream_loss"]
        time.sleep(0.2)
