"""The thin trainer under torchrun against a real service: resume (and what a run reports),
the mixing policy, and the demo."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import free_port, patient

pytestmark = pytest.mark.slow
SMALL = ["--hidden", "32", "--layers", "1", "--lr", "3e-3"]


@pytest.fixture
def make_service(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(20, max_bytes=3000))
    cfg = parse_config({"seed": 5, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}})  # fmt: skip
    actors = []

    def make(name):
        actors.append(start_server(cfg, name=name, prefetch=4))
        return name

    yield make
    for a in actors:
        ray_cluster.kill(a)


def torchrun(ray_cluster, ranks, service, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "trainer.train", "--service", service,
           "--address", ray_cluster.get_runtime_context().gcs_address, *SMALL, *args]  # fmt: skip
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=patient(300),
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def losses(path):
    return {rec["step"]: rec["loss"] for rec in map(json.loads, path.read_text().splitlines())}


def test_checkpoint_resume_continues_with_the_same_batches(ray_cluster, make_service, tmp_path):
    """A straight run of 6 steps keeps its checkpoint of step 3 (`--keep-checkpoints`); a run
    resumed from it (`--resume-step 3`) on the same service, which has served past step 6,
    trains steps 4-6 on the same batches with the same model and optimizer: the same losses.
    (One straight run, not a straight run and a first half: a torchrun launch is ~17 CPU-s.)"""
    service = make_service(f"resumed{os.getpid()}")
    ckpt = tmp_path / "ckpt"
    out = torchrun(ray_cluster, 2, service, "--steps", "6", "--checkpoint", str(ckpt),
                   "--checkpoint-every", "3", "--keep-checkpoints",
                   "--log-json", str(tmp_path / "straight.jsonl"))  # fmt: skip
    # What a run says of itself (the smoke check: a torchrun launch of its own cost ~40 CPU-s)
    assert "global batch = 2 x 2 x 1 = 4 rows" in out
    recs = [json.loads(x) for x in (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert all({"step_time_s", "data_wait_s", "tokens_per_s", "loss"} <= r.keys() for r in recs)
    summary = json.loads(next(x for x in out.splitlines() if x.startswith('{"summary"')))["summary"]
    assert summary["steps"] == 6 and summary["loss_first"] > 0
    kept = sorted(p.name for p in ckpt.iterdir())
    assert kept == ["checkpoint-3.pt", "checkpoint-6.pt", "checkpoint.pt"], kept
    out = torchrun(ray_cluster, 2, service, "--steps", "6", "--checkpoint", str(ckpt),
                   "--resume-step", "3", "--log-json", str(tmp_path / "second.jsonl"))  # fmt: skip
    assert f"resumed from {ckpt / 'checkpoint-3.pt'} at step 3" in out
    straight, second = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "second.jsonl")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6] and sorted(second) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second[step] == pytest.approx(straight[step], rel=1e-5), step


@pytest.mark.slow
def test_demo_with_the_mixing_policy_shows_its_weight_history(ray_cluster, tmp_path):
    """`demo --policy` (one demo run, the longest test: the demo's own summary is checked
    here too): the torchrun ranks report their loss per stream each step, and the service's
    first decision (step 5 + 18) follows the mean loss of steps 0-4, within bounds. Ten steps
    trained are enough: the producer runs 16 steps ahead of the ranks (the demo's prefetch),
    so it reaches step 23 and decides there once the ranks have reported step 4."""
    address = ray_cluster.get_runtime_context().gcs_address
    r = subprocess.run([sys.executable, "-m", "service", "demo", "--steps", "10", "--policy",
                        "--address", address, "--json", str(tmp_path / "s.json"),
                        "--out", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=patient(600))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    # The demo's summary: what it prints and writes.
    for key in ("tokens_per_s", "packing_efficiency", "data_wait_fraction", "mixture",
                "loss_first", "loss_last"):  # fmt: skip
        assert key in s
    assert set(s["mixture"]) == {"code", "chat"} and s["steps"] == 10
    assert s["policy_config"]["weights"] == {"code": pytest.approx(0.7), "chat": pytest.approx(0.3)}
    assert "packing" in r.stdout and "data wait" in r.stdout
    # the ranks' loss per stream, reported each step and joined by the service
    assert set(s["stream_loss"]) == {"code", "chat"}
    assert all(v is not None and 0 < v < 20 for v in s["stream_loss"].values()), s["stream_loss"]
    first = s["policy"][0]
    assert first["step"] == 23 and first["window"] == [0, 5]
    assert set(first["loss"]) == {"code", "chat"} and all(
        0 < v < 20 for v in first["loss"].values()
    )
    w = first["weights"]
    assert (
        sum(w.values()) == pytest.approx(1) and 0.35 <= w["code"] <= 1 and 0.15 <= w["chat"] <= 0.6
    )
    # the higher loss gains weight (from 0.7 / 0.3), the lower one loses it
    hard = max(first["loss"], key=first["loss"].get)
    assert w[hard] > {"code": 0.7, "chat": 0.3}[hard]
    assert "mixing policy: " in r.stdout and "window" in r.stdout


def test_the_mixing_policy_under_torchrun_resumes_on_a_new_service(ray_cluster, tmp_path):
    """Two torchrun ranks report their loss per stream; the policy decides at steps 3, 5, 7
    (every 2, delay 1). The checkpoint's feed state (step 4) carries the loss of steps 2-3
    that decision 5 reads; a new service, resumed from it by the ranks, decides on."""
    import ray
    import torch

    from pipeline.stages.policy import LOSSES, needed_steps

    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(20, max_bytes=3000))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(20, start=40, max_bytes=3000))
    cfg = parse_config({"seed": 5, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.5},
                                    "b": {"paths": [str(tmp_path / "b.jsonl")], "weight": 0.5}},
                        "mixing": {"policy": {"every": 2, "delay": 1, "wait_s": patient(60)}}})  # fmt: skip
    ckpt = tmp_path / "ckpt"
    first = start_server(cfg, name=f"policy1-{os.getpid()}", prefetch=4)
    try:
        torchrun(ray_cluster, 2, f"policy1-{os.getpid()}", "--steps", "4",
                 "--checkpoint", str(ckpt))  # fmt: skip
        decided = [c["step"] for c in ray.get(first.mixture.remote())["history"]
                   if c["source"] == "policy"]  # fmt: skip
    finally:
        ray_cluster.kill(first)
    feed = json.loads(torch.load(ckpt / "checkpoint.pt", weights_only=True)["feed"])
    assert feed["step"] == 4 and 3 in decided
    assert sorted(int(s) for s in feed[LOSSES]) == sorted(needed_steps(4, 2, 1)) == [2, 3]
    second = start_server(cfg, name=f"policy2-{os.getpid()}", prefetch=4)
    try:
        torchrun(ray_cluster, 2, f"policy2-{os.getpid()}", "--steps", "8",
                 "--checkpoint", str(ckpt), "--resume")  # fmt: skip
        history = ray.get(second.mixture.remote())["history"]
    finally:
        ray_cluster.kill(second)
    assert {5, 7} <= {c["step"] for c in history if c["source"] == "policy"}
