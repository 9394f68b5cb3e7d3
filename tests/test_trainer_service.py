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


def test_a_run_resumed_on_a_new_service_trains_on_the_same_batches_and_the_policy_decides_on(
    ray_cluster, tmp_path
):
    """A straight run of 6 steps under torchrun, the mixing policy deciding at steps 3, 5, 7
    (every 2, delay 1) from the ranks' loss per stream, keeps its checkpoint of step 3
    (`--keep-checkpoints`), whose feed state carries the loss of steps 0-2 that decisions 3
    and 5 read. A run resumed from it (`--resume-step 3`) on a new service trains steps 4-6
    on the same batches with the same model and optimizer (the same losses) and the new
    service decides as the first did. One test for both, two torchrun launches (each ~17
    CPU-s); a rank's rewind on the same service: test_adapters.py, test_swift.py."""
    import ray
    import torch

    from pipeline.stages.policy import LOSSES, SOURCE, needed_steps

    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(20, max_bytes=3000))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(20, start=40, max_bytes=3000))
    cfg = parse_config({"seed": 5, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.5},
                                    "b": {"paths": [str(tmp_path / "b.jsonl")], "weight": 0.5}},
                        "mixing": {"policy": {"every": 2, "delay": 1, "wait_s": patient(60)}}})  # fmt: skip
    ckpt = tmp_path / "ckpt"

    def run(tag: str, *args: str) -> tuple[str, dict[int, dict]]:
        """torchrun on a new service: its output and the policy's decisions {step: weights}."""
        name = f"{tag}-{os.getpid()}"
        actor = start_server(cfg, name=name, prefetch=4)
        try:
            out = torchrun(ray_cluster, 2, name, "--steps", "6", "--checkpoint", str(ckpt),
                           "--log-json", str(tmp_path / f"{tag}.jsonl"), *args)  # fmt: skip
            history = ray.get(actor.mixture.remote())["history"]
        finally:
            ray_cluster.kill(actor)
        return out, {c["step"]: c["weights"] for c in history if c["source"] == SOURCE}

    out, decided = run("straight", "--checkpoint-every", "3", "--keep-checkpoints")
    # What a run says of itself (the smoke check: a torchrun launch of its own cost ~40 CPU-s)
    assert "global batch = 2 x 2 x 1 = 4 rows" in out
    recs = [json.loads(x) for x in (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert all({"step_time_s", "data_wait_s", "tokens_per_s", "loss"} <= r.keys() for r in recs)
    summary = json.loads(next(x for x in out.splitlines() if x.startswith('{"summary"')))["summary"]
    assert summary["steps"] == 6 and summary["loss_first"] > 0
    kept = sorted(p.name for p in ckpt.iterdir())
    assert kept == ["checkpoint-3.pt", "checkpoint-6.pt", "checkpoint.pt"], kept
    assert {3, 5} <= decided.keys(), decided
    feed = json.loads(torch.load(ckpt / "checkpoint-3.pt", weights_only=True)["feed"])
    assert feed["step"] == 3
    assert sorted(int(s) for s in feed[LOSSES]) == sorted(needed_steps(3, 2, 1)) == [0, 1, 2]

    out, redecided = run("second", "--resume-step", "3")
    assert f"resumed from {ckpt / 'checkpoint-3.pt'} at step 3" in out
    straight, second = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "second.jsonl")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6] and sorted(second) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second[step] == pytest.approx(straight[step], rel=1e-5), step
    # decision 5 reads step 2's loss from the state and step 3's from the resumed ranks
    for step in (3, 5):
        assert redecided[step] == pytest.approx(decided[step], rel=1e-5), (step, redecided)


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
