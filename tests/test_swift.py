"""ms-swift on tokenmill through trainer/swift.py: `swift sft` and `swift pt` on CPU with a tiny
local Qwen2 against a live service; `swift pt`'s two gloo ranks get `export --world-size 2`; an
`sft` run resumed from checkpoint-2 (also with --resume_only_model) gets the batches the
straight run got.

Swift runs in its own venv (.venv-swift: transformers 5, trl<1; dev-extras/swift-venv.sh, which
`./dev test` runs first). Without it the module is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient
from tests.test_ranks import exported
from trainer.adapters import FEED_STATE_FILE

ROOT = Path(__file__).resolve().parents[1]
SWIFT_BIN = ROOT / ".venv-swift" / "bin"
LENGTH, BATCH = 128, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (SWIFT_BIN / "swift").exists(),
        reason="no ms-swift venv at .venv-swift: `./dev test` (dev-extras/swift-venv.sh) creates it",
    ),
]

# A second plugin, after trainer/swift.py: the same trainer, recording each micro-batch as the
# trainer receives it (before swift's _prepare_inputs) in $RECORD/rank<r>.jsonl.
RECORDER = """
import json, os
from swift.trainers import TrainerFactory
import trainer.swift as tm

class Recording(tm.swift_feed_trainer()):
    def training_step(self, model, inputs, *args, **kwargs):
        row = {k: inputs[k].tolist() for k in ("input_ids", "labels", "position_ids")}
        row["keys"] = sorted(inputs)
        path = os.path.join(os.environ["RECORD"], f"rank{self.args.process_index}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\\n")
        return super().training_step(model, inputs, *args, **kwargs)

TrainerFactory.TRAINER_MAPPING["causal_lm"] = __name__ + ".Recording"
"""

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    """A Qwen2 of 32 hidden units, random weights, and a 400-token byte-level BPE trained here
    on standard-library sources: one directory for swift (--model) and the service (tokenizer)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # fmt: skip
    tok.train_from_iterator(stdlib_texts(40), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT)  # fmt: skip
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def service_config(tiny_qwen, tmp_path_factory):
    data = tmp_path_factory.mktemp("swift-data") / "a.jsonl"
    write_jsonl(data, stdlib_texts(60, max_bytes=120))  # documents of ~40-60 tokens
    return parse_config({"seed": 5, "seq_len": LENGTH, "global_batch_size": BATCH,
                         "shuffle": {"window": 4}, "tokenizer": {"name": str(tiny_qwen)},
                         "streams": {"a": {"paths": [str(data)]}}})  # fmt: skip


@pytest.fixture
def make_service(ray_cluster, service_config):
    actors = []

    def make(name: str) -> str:
        name = f"{name}{os.getpid()}"
        actors.append(start_server(service_config, name=name, prefetch=4))
        return name

    yield make
    for a in actors:
        ray_cluster.kill(a)


def swift(cmd: str, service: str, model: Path, out: Path, *extra: str, ranks: int = 1,
          address: str, timeout: int = 300) -> dict:  # fmt: skip
    """Run `swift CMD` through the plugin (and the recorder); return its micro-batches per
    rank, its log records and its output directory."""
    out.mkdir(parents=True, exist_ok=True)
    recorder = out / "recorder.py"
    recorder.write_text(RECORDER)
    env = os.environ | {
        "TOKENMILL_SERVICE": service, "TOKENMILL_RAY_ADDRESS": address, "RECORD": str(out),
        "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
        "PATH": f"{SWIFT_BIN}:{os.environ['PATH']}", "NPROC_PER_NODE": str(ranks),
        "MASTER_PORT": str(_free_port()),
    }  # fmt: skip
    if ranks == 1:
        env.pop("NPROC_PER_NODE")
    args = [str(SWIFT_BIN / "swift"), cmd, "--external_plugins", str(ROOT / "trainer" / "swift.py"),
            str(recorder), "--model", str(model), "--model_type", "qwen2", "--template", "qwen",
            "--dataset", "tokenmill", "--streaming", "true", "--tuner_type", "full",
            "--torch_dtype", "float32", "--report_to", "none", "--check_model", "false",
            "--output_dir", str(out / "run"), "--add_version", "false", "--logging_steps", "1",
            "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--seed", "0",
            "--dataloader_pin_memory", "false", *extra]  # fmt: skip
    if ranks > 1:
        args += ["--ddp_backend", "gloo"]
    log = out / "swift.log"
    with open(log, "w") as f:
        proc = subprocess.run(args, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    seen = {}
    for r in range(ranks):
        rows = (out / f"rank{r}.jsonl").read_text().splitlines()
        seen[r] = [json.loads(line) for line in rows]
    logs = [json.loads(line) for line in (out / "run" / "logging.jsonl").read_text().splitlines()]
    return {"seen": seen, "logs": [h for h in logs if "loss" in h], "dir": out / "run", "log": text}


def _free_port() -> int:
    from tests.rayhead import free_port

    return free_port()


@pytest.fixture
def run(ray_cluster, make_service, tiny_qwen, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address

    def go(name: str, service: str, *extra: str, cmd: str = "sft", ranks: int = 1) -> dict:
        return swift(cmd, service, tiny_qwen, tmp_path / name, *extra, ranks=ranks,
                     address=address)  # fmt: skip

    return go


def _ids(seen: list) -> list:
    return [b["input_ids"] for b in seen]


def test_swift_sft_trains_on_the_feed_and_resumes_exactly(run, make_service):
    """One rank, 4 steps, a checkpoint at 2; then resumed from it, plainly and with
    --resume_only_model: the resumed runs get the straight run's batches 3 and 4."""
    service = make_service("swift-sft")
    straight = run("straight", service, "--max_steps", "4", "--save_steps", "2",
                   "--gradient_accumulation_steps", "2")  # fmt: skip
    seen = straight["seen"][0]
    assert len(seen) == 8 and all(
        b["keys"] == ["input_ids", "labels", "position_ids"] for b in seen
    )
    first = np.array(seen[0]["input_ids"])
    assert first.shape == (BATCH, LENGTH), first.shape
    positions = np.array([b["position_ids"] for b in seen])
    assert (positions == 0).sum() > 2 * positions.shape[0] * BATCH, "rows pack documents"
    logs = straight["logs"]
    assert [h["global_step/max_steps"] for h in logs] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(0 <= float(h["data_wait_fraction"]) <= 1 and "data_wait_s" in h for h in logs), logs
    ckpt = straight["dir"] / "checkpoint-2"
    assert json.loads((ckpt / FEED_STATE_FILE).read_text())["step"] == 4  # micro-batches

    # The service has served 4 steps: each resume rewinds it to the checkpoint's.
    resumed = run("resumed", service, "--max_steps", "4", "--resume_from_checkpoint", str(ckpt),
                  "--gradient_accumulation_steps", "2")  # fmt: skip
    assert _ids(resumed["seen"][0]) == _ids(seen[4:])
    for got, want in zip(resumed["logs"][-2:], logs[2:], strict=True):
        assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-3), (got, want)

    # Swift loads only the weights and clears the resume path; the feed resumes all the same.
    only_model = run("only-model", service, "--max_steps", "2", "--resume_from_checkpoint",
                     str(ckpt), "--resume_only_model", "true", "--ignore_data_skip", "true",
                     "--gradient_accumulation_steps", "2")  # fmt: skip
    assert _ids(only_model["seen"][0]) == _ids(seen[4:])
    assert "the feed resumes from" in only_model["log"]


def test_swift_pt_under_two_gloo_ranks_gets_each_rank_its_rows_of_the_export(
    run, make_service, service_config, tmp_path
):
    """`swift pt` (pretraining: loss_scale 'all') with two gloo ranks, 3 steps: each rank's
    micro-batches are its rows of `export --world-size 2`, and each step is logged. (`sft`
    with one rank: the test above; one launch for `pt` and for two ranks, each ~25 s here.)"""
    steps = 3
    two = run("two", make_service("swift-pt"), "--max_steps", str(steps),
              "--gradient_accumulation_steps", "1", ranks=2, cmd="pt")  # fmt: skip
    want = exported(service_config, tmp_path, steps, 2)
    for rank in (0, 1):
        seen = two["seen"][rank]
        assert len(seen) == steps, rank
        for step, batch in enumerate(seen):
            np.testing.assert_array_equal(np.array(batch["input_ids"]), want[(step, rank)][0])
            np.testing.assert_array_equal(np.array(batch["labels"]), want[(step, rank)][1])
    assert two["seen"][0][0]["input_ids"] != two["seen"][1][0]["input_ids"]
    assert [h["global_step/max_steps"] for h in two["logs"]] == [f"{s}/{steps}" for s in (1, 2, 3)]


CHECKS = """
import sys, torch
from types import SimpleNamespace
from transformers import AutoModelForCausalLM
import torch.nn.functional as F
from trainer.adapters import hf_batch, prepare_packed
from trainer.swift import check_template

def refused(**kw):
    t = SimpleNamespace(sequence_parallel_size=1, _loss_scale="default", padding_free=False)
    t.__dict__.update(kw)
    try:
        check_template(t, 1)
    except ValueError as e:
        return str(e)
    return None

assert refused() is None and refused(padding_free=True) is None
assert "--sequence_parallel_size 2" in refused(sequence_parallel_size=2)
assert "--loss_scale 'last_round'" in refused(_loss_scale="last_round")
assert refused(_loss_scale="default+ignore_empty_think") is None

# transformers 5 (swift's): packed rows with position_ids only give each document's own loss.
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa").eval()
assert prepare_packed(model) is False
g = torch.Generator().manual_seed(7)
docs = [torch.randint(1, 390, (n,), generator=g) for n in (20, 30, 10)]
ids = torch.cat(docs)[None]
labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
with torch.no_grad():
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    packed = model(**hf_batch(batch)).loss * int((labels != -100).sum())
    alone = sum(F.cross_entropy(model(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum")
                for d in docs)
    crossed = model(input_ids=ids, labels=labels).loss * int((labels != -100).sum())
gap, cross = float(packed - alone), float(crossed - alone)
assert abs(gap) < 1e-3 and abs(cross) > 1e-3, (gap, cross)
print("ok", gap, cross)
"""


def test_swift_venv_refusals_and_packed_loss_equals_unpacked(tiny_qwen):
    proc = subprocess.run([str(SWIFT_BIN / "python"), "-c", textwrap.dedent(CHECKS), str(tiny_qwen)],
                          env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=patient(300))  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
