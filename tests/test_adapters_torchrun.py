"""HF `Trainer` (FeedTrainer) under torchrun: two CPU ranks (gloo) train, checkpoint, and
resume from a checkpoint on a new service with the next batches and the optimizer's state.

On CPU with several ranks, transformers 4.57 loads `optimizer.pt` with
`map_location=args.device`, `cpu:N`, which torch cannot restore ("don't know how to restore
data location of torch.storage.UntypedStorage (tagged with cpu:0)"): FeedTrainer loads it
onto the CPU there (trainer/adapters.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient
from trainer.adapters import load_feed_state

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# One rank under torchrun: FeedTrainer on HF's tiny Llama, a checkpoint every 2 steps; writes
# each optimizer step's input ids and loss.
RANK = r"""
import json, os, sys
import torch
from transformers import TrainingArguments
from tests.test_adapters import TOKENIZER_VOCAB, tiny_llama
from trainer.adapters import FeedDataset, FeedTrainer
service, address, out, steps, resume = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
save_steps = int(sys.argv[6])
torch.set_num_threads(1)
seen = []
class Recording(FeedTrainer):
    def training_step(self, model, inputs, *args, **kwargs):
        seen.append(inputs["input_ids"].tolist())
        return super().training_step(model, inputs, *args, **kwargs)
args = TrainingArguments(
    output_dir=out, max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant",
    logging_steps=1, save_strategy="steps", save_steps=save_steps, use_cpu=True, report_to=[],
    disable_tqdm=True, seed=0, dataloader_pin_memory=False, ddp_backend="gloo")
trainer = Recording(model=tiny_llama(TOKENIZER_VOCAB), args=args,
                    train_dataset=FeedDataset(service=service, address=address))
trainer.train(resume_from_checkpoint=resume or None)
losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
json.dump({"seen": seen, "losses": losses, "end": trainer.state.log_history[-1]},
          open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w"))
"""


def _launch(service: str, address: str, out: Path, steps: int, resume: str = "",
            save_steps: int = 2) -> subprocess.Popen:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    script = out / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(out / "torchrun.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", str(script), service, address, str(out),
                                 str(steps), resume, str(save_steps)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)  # fmt: skip


def _results(proc: subprocess.Popen, out: Path) -> list[dict]:
    """Both ranks exited 0; what each saw."""
    assert proc.wait(timeout=patient(600)) == 0, (out / "torchrun.log").read_text()[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _torchrun(service: str, address: str, out: Path, steps: int, resume: str = "") -> list[dict]:
    return _results(_launch(service, address, out, steps, resume), out)


def test_hf_trainer_under_torchrun_resumes_with_the_next_batches_and_its_optimizer(
    ray_cluster, tmp_path
):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(20, max_bytes=3000))
    cfg = parse_config({"seed": 5, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}})  # fmt: skip
    address = ray_cluster.get_runtime_context().gcs_address
    actors = []
    try:
        name = f"hf-straight{os.getpid()}"
        actors.append(start_server(cfg, name=name, prefetch=4))
        straight = _torchrun(name, address, tmp_path / "a", 4)
        checkpoint = tmp_path / "a" / "checkpoint-2"
        assert (checkpoint / "optimizer.pt").exists()
        name = f"hf-resumed{os.getpid()}"  # a new service: the ranks' states seek it
        actors.append(start_server(cfg, name=name, prefetch=4))
        resumed = _torchrun(name, address, tmp_path / "b", 4, str(checkpoint))
    finally:
        for a in actors:
            ray_cluster.kill(a)
    for r in range(2):
        assert len(straight[r]["seen"]) == 4 and len(resumed[r]["seen"]) == 2
        assert resumed[r]["seen"] == straight[r]["seen"][2:], f"rank {r}: the next batches"
        for step in ("3", "4"):  # the optimizer's moments restored: the same losses
            assert resumed[r]["losses"][step] == pytest.approx(
                straight[r]["losses"][step], rel=1e-5
            ), (r, step, resumed[r]["losses"], straight[r]["losses"])
    assert straight[0]["seen"] != straight[1]["seen"]  # each rank its own rows


def test_a_stop_drains_hf_ranks_under_torchrun_into_a_last_checkpoint(ray_cluster, tmp_path):
    """`tokenmill stop` (the service's request_stop) while two torchrun ranks train with no
    checkpoint due for 500 steps: both get every step made, end cleanly (exit 0), and write a
    last checkpoint at their last step, whose feed state resumes after it."""
    import ray

    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(20, max_bytes=3000))
    cfg = parse_config({"seed": 5, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")],
                                          "repeat": 100}}})  # fmt: skip
    address = ray_cluster.get_runtime_context().gcs_address
    name = f"hf-stop{os.getpid()}"
    actor = start_server(cfg, name=name, prefetch=4)
    try:
        proc = _launch(name, address, tmp_path / "s", 1000, save_steps=500)
        deadline = time.time() + patient(300)
        while True:  # both ranks training
            ranks = ray.get(actor.metrics.remote(), timeout=30)["ranks"]
            if len(ranks) == 2 and all((v.get("consumed_step") or 0) >= 3 for v in ranks.values()):
                break
            assert proc.poll() is None and time.time() < deadline, (
                tmp_path / "s" / "torchrun.log"
            ).read_text()[-4000:]
            time.sleep(0.5)
        ray.get(actor.request_stop.remote(False), timeout=30)
        got = _results(proc, tmp_path / "s")
    finally:
        ray_cluster.kill(actor)
    steps = len(got[0]["seen"])
    assert steps == len(got[1]["seen"]) and 3 <= steps < 1000
    last = tmp_path / "s" / f"checkpoint-{steps}"
    assert (last / "optimizer.pt").exists(), sorted(p.name for p in (tmp_path / "s").iterdir())
    state = load_feed_state(last)
    assert state["step"] == steps, state["step"]  # the next step a resume takes
    for r in range(2):  # the speeds of the steps trained, not of max_steps (1000)
        end = got[r]["end"]
        assert end["train_steps_per_second"] * end["train_runtime"] == pytest.approx(
            steps, rel=0.01
        )
        rows = 4 * steps  # global_batch_size 4: each rank 2 rows a step, 2 ranks
        assert end["train_samples_per_second"] * end["train_runtime"] == pytest.approx(
            rows, rel=0.01
        )
