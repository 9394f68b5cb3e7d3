"""torchtitan on tokenmill through trainer/titan.py, on CPU: the loader against a live service
(two data-parallel ranks; its batches are the feed's own, labels shifted one left; its DCP state
round-trips and a resumed loader continues exactly), the refusals, and torchtitan's llama3 debug
model with flex attention: packed rows, through the Trainer's own mask building and the compiled
kernel, give each document's own logits and loss (each document alone on flex's reference
path), and differ without the document mask.

torchtitan 0.3.0 lives in the extras venv (.venv-swift, dev-extras/swift-venv.sh, which
`./dev test` runs first); the checks run there as scripts. Without it the module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-swift" / "bin" / "python"
HAS_TITAN = any(
    (ROOT / ".venv-swift" / "lib").glob("python3*/site-packages/torchtitan/__init__.py")
)
LENGTH, BATCH = 64, 4  # two data-parallel ranks of 2 rows each

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PYTHON.exists() and HAS_TITAN),
        reason="no torchtitan in .venv-swift: `./dev test` (dev-extras/swift-venv.sh) installs it",
    ),
]


def run_titan(script: str, *args: str, timeout: int = 240) -> dict:
    """Run `script` in the torchtitan venv; it prints one JSON line of figures last."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(PYTHON), "-c", textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOADER = """
import json, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from trainer.feed import Feed
from trainer.titan import STATE_KEY, TokenmillDataLoader, titan_batch

address, service, ckpt, tmp = sys.argv[1:5]
L, ROWS, WORLD = 64, 2, 2
cfg = TokenmillDataLoader.Config(service=service, address=address, timeout_s=120)

def loaders():
    return [cfg.build(dp_world_size=WORLD, dp_rank=r, tokenizer=None, seq_len=L,
                      local_batch_size=ROWS, snapshot_every_n_steps=None) for r in range(WORLD)]

def take(its, n):  # n steps of every rank, in lockstep
    return [[next(it) for it in its] for _ in range(n)]

first = loaders()
start = json.loads(first[0].state_dict()[STATE_KEY])  # before any batch: step 0
its = [iter(x) for x in first]
head = take(its, 3)
dcp.save({"dataloader": first[0]}, checkpoint_id=ckpt)  # one process, no process group
states = [x.state_dict() for x in first]
assert states[0] == states[1] and json.loads(states[0][STATE_KEY])["step"] == 3, states
straight = take(its, 3)

second = loaders()  # a new run: DCP loads the state into fresh loaders
for x in second:
    dcp.load({"dataloader": x}, checkpoint_id=ckpt)
resumed = take([iter(x) for x in second], 3)

# The feed's own batches, from the loaders' first state.
feeds = [Feed.connect(service=service, rank=r, world_size=WORLD, address=address, state=start)
         for r in range(WORLD)]
raw = take(feeds, 6)
for got, want in zip(head + straight, raw, strict=True):
    for (inputs, labels), b in zip(got, want, strict=True):
        assert sorted(inputs) == ["input", "positions"], sorted(inputs)
        assert inputs["input"].shape == (ROWS, L) and inputs["input"].dtype == torch.int64
        assert torch.equal(inputs["input"], b["input_ids"])
        assert torch.equal(inputs["positions"], b["position_ids"])
        assert torch.equal(labels[:, :-1], b["labels"][:, 1:]) and (labels[:, -1] == -100).all()
        # The next token of each document's last token is another document's first: no target.
        ends = (b["position_ids"][:, 1:] == 0)
        assert (labels[:, :-1][ends] == -100).all()
for got, want in zip(resumed, straight, strict=True):
    for (gi, gl), (wi, wl) in zip(got, want, strict=True):
        assert torch.equal(gi["input"], wi["input"]) and torch.equal(gl, wl)
        assert torch.equal(gi["positions"], wi["positions"])
assert not torch.equal(head[0][0][0]["input"], head[0][1][0]["input"]), "ranks get their own rows"

# Refusals: no positions, the wrong sizes, a data-parallel rank shared by other ranks.
def refused(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("not refused")

b = dict(raw[0][0])
no_pos = refused(lambda: titan_batch({k: v for k, v in b.items() if k != "position_ids"}))
sizes = refused(lambda: titan_batch(b, 4, L))
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
shared = refused(lambda: cfg.build(dp_world_size=2, dp_rank=0))
dist.destroy_process_group()
assert "no position_ids" in no_pos and "training.local_batch_size" in sizes, (no_pos, sizes)
assert "1 ranks in the process group, 2 in the data-parallel mesh" in shared, shared
docs = int(sum((x["position_ids"] == 0).sum() for step in raw for x in step))
print(json.dumps({"steps": len(raw), "resume_step": 3, "doc_starts": docs,
                  "labelled": int(sum((x["labels"] != -100).sum() for step in raw for x in step))}))
"""


@pytest.fixture(scope="module")
def service_config(tmp_path_factory):
    data = tmp_path_factory.mktemp("titan-data") / "a.jsonl"
    write_jsonl(data, stdlib_texts(40, max_bytes=150))  # documents of ~40 tokens
    return parse_config({"seed": 3, "seq_len": LENGTH, "global_batch_size": BATCH,
                         "shuffle": {"window": 4}, "streams": {"a": {"paths": [str(data)]}}})  # fmt: skip


def test_loader_yields_the_feed_shifted_and_resumes_exactly(ray_cluster, service_config, tmp_path):
    name = f"titan{os.getpid()}"
    actor = start_server(service_config, name=name, prefetch=4)
    try:
        address = ray_cluster.get_runtime_context().gcs_address
        got = run_titan(LOADER, address, name, str(tmp_path / "ckpt"), str(tmp_path))
    finally:
        ray_cluster.kill(actor)
    assert got["steps"] == 6 and got["doc_starts"] > 6 * BATCH, got  # rows pack documents


MODEL = """
import json
from types import SimpleNamespace
import torch
import torch.nn.functional as F
from torchtitan.trainer import Trainer
from trainer.titan import check_document_mask, llama3_debugmodel, titan_batch

config = llama3_debugmodel()  # torchtitan's debug run, our loader; flex attention
check_document_mask(config)
spec = config.model_spec
torch.manual_seed(0)
model = spec.model.build()
model.init_states(buffer_device=None)
model.eval()
vocab = spec.model.vocab_size

# Two packed rows as the service serves them: documents, then padding (position 0, no label).
g = torch.Generator().manual_seed(7)
rows = [[50, 40, 30], [60, 64]]
L = 128
docs = [[torch.randint(1, vocab, (n,), generator=g) for n in lens] for lens in rows]
def row(ds, pad):
    ids = torch.cat(ds + [torch.zeros(pad, dtype=torch.long)])
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in ds] + [torch.full((pad,), -100)])
    pos = torch.cat([torch.arange(len(d)) for d in ds] + [torch.zeros(pad, dtype=torch.long)])
    return ids, labels, pos
built = [row(ds, L - sum(map(len, ds))) for ds in docs]
batch = {k: torch.stack([b[i] for b in built]) for i, k in enumerate(["input_ids", "labels", "position_ids"])}
input_dict, labels = titan_batch(batch, 2, L)

# The Trainer's own step from a batch to the model's arguments (mask from positions).
fake = SimpleNamespace(model_config=spec.model, model_parts=[model], ntokens_seen=0,
                       parallel_dims=SimpleNamespace(cp_enabled=False),
                       config=SimpleNamespace(parallelism=SimpleNamespace(spmd_backend="partial_dtensor")))
with torch.no_grad():  # as the packed pass below: the mask compiles once, not twice
    inputs, labels, extra = Trainer.post_dataloading_process(fake, input_dict, labels)
assert sorted(extra) == ["attention_masks", "positions"], sorted(extra)
with torch.no_grad():
    packed = model(inputs, **extra)
    loss = F.cross_entropy(packed.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    # Each document alone, and the row without its document mask, through flex attention's
    # reference (eager) path: the compiled kernel above is checked against it, and each of
    # those shapes would compile anew on the CPU (44 s of a cold run; 25 s in all this way).
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention as titan_attention
    titan_attention.FlexAttention._compiled_flex_attn = flex_attention
    titan_attention._compiled_create_block_mask = create_block_mask
    gap, alone_loss = 0.0, 0.0
    for r, ds in enumerate(docs):
        s = 0
        for d in ds:
            p = torch.arange(len(d))[None]
            out = model(d[None], positions=p, attention_masks=model.get_attention_masks(positions=p))
            gap = max(gap, float((out[0] - packed[r, s:s + len(d)]).abs().max()))
            alone_loss += float(F.cross_entropy(out[0, :-1], d[1:], reduction="sum"))
            s += len(d)
    # Without the document mask (causal over the whole row), positions still restarting.
    whole = torch.arange(L).expand(2, L)
    crossed = model(inputs, positions=extra["positions"], attention_masks=model.get_attention_masks(positions=whole))
    cross = float((crossed - packed).abs().max())
assert gap < 1e-4 and cross > 1e-2, (gap, cross)
assert abs(float(loss) - alone_loss) < 1e-3 * alone_loss, (float(loss), alone_loss)
print(json.dumps({"logit_gap": gap, "unmasked_gap": cross, "loss_packed": float(loss),
                  "loss_alone": alone_loss, "labelled": int((labels != -100).sum())}))
"""


def test_llama3_debug_model_packed_rows_equal_documents_alone():
    got = run_titan(MODEL)
    assert got["labelled"] == (50 + 40 + 30 + 60 + 64) - 5, got
    print(got)
