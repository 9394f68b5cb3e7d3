"""The training loop on synthetic packed batches: learning, accumulation, checkpoints, DDP."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch

from trainer.model import IGNORE_INDEX, small_llama
from trainer.train import load_checkpoint, save_checkpoint, train

VOCAB, LENGTH, ROWS = 512, 64, 4
TENSOR_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(torch_one_thread):
    """Tiny models: one intra-op thread (conftest's `torch_one_thread`)."""


def synthetic_batches(seed: int, rows: int = ROWS, length: int = LENGTH):
    """Endless packed batches of counting documents (token t is followed by t + 1 mod 16).

    Documents of 8..30 tokens are packed first-fit in order; the tail of a row is padding.
    """
    g = torch.Generator().manual_seed(seed)
    for step in itertools.count():
        batch = {k: torch.zeros(rows, length, dtype=torch.long) for k in TENSOR_KEYS}
        batch["labels"].fill_(IGNORE_INDEX)
        batch["seq_lens"], batch["global_step"] = [], step
        for r in range(rows):
            start, lens = 0, []
            while True:
                n = int(torch.randint(8, 31, (), generator=g))
                if start + n > length:
                    break
                first = int(torch.randint(0, 16, (), generator=g))
                doc = (torch.arange(n) + first) % 16 + 1
                batch["input_ids"][r, start : start + n] = doc
                batch["labels"][r, start + 1 : start + n] = doc[1:]
                batch["position_ids"][r, start : start + n] = torch.arange(n)
                batch["segment_ids"][r, start : start + n] = len(lens) + 1
                lens.append(n)
                start += n
            batch["seq_lens"].append(lens)
        yield batch


def concat(batches: list[dict]) -> dict:
    out = {k: torch.cat([b[k] for b in batches]) for k in TENSOR_KEYS}
    out["seq_lens"] = [lens for b in batches for lens in b["seq_lens"]]
    return out


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return small_llama(vocab_size=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, seq_len=LENGTH)


def test_loss_falls_and_logs_every_step():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    records, waits, seen = [], [], []
    summary = train(
        model,
        synthetic_batches(0),
        steps=30,
        grad_accum=1,
        optimizer=opt,
        log=records.append,
        report_wait=waits.append,
        on_step=seen.append,
    )
    assert summary["steps"] == 30 and seen == list(range(1, 31)) and len(waits) == 30
    assert summary["loss_last"] < 0.5 * summary["loss_first"], summary
    assert 0.0 <= summary["data_wait_fraction"] < 1.0 and summary["tokens_per_s"] > 0
    assert set(records[0]) == {"step", "step_time_s", "data_wait_s", "tokens_per_s", "loss"}
    assert [r["step"] for r in records] == list(range(1, 31))


def test_grad_accumulation_equals_one_big_batch():
    m1, m2 = itertools.islice(synthetic_batches(1, rows=2), 2)
    # Different real-token counts per micro-batch: only token weighting makes these agree.
    m2["labels"][:, 40:] = IGNORE_INDEX
    accum, big = tiny_model(), tiny_model()
    for model, batches, k in ((accum, [m1, m2], 2), (big, [concat([m1, m2])], 1)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        train(model, iter(batches), steps=1, grad_accum=k, optimizer=opt, log=lambda r: None)
    for (name, a), b in zip(accum.named_parameters(), big.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(accum.model.norm.weight, tiny_model().model.norm.weight)


def test_checkpoint_roundtrip(tmp_path: Path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_batches(2)
    train(model, batches, steps=3, grad_accum=1, optimizer=opt, log=lambda r: None)
    feed_state = {"global_step": 3, "streams": {"web": [1, 2]}, "weights": None}
    save_checkpoint(tmp_path / "checkpoint.pt", model, opt, feed_state, step=3)

    restored = tiny_model(seed=1)
    ropt = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    step, state = load_checkpoint(tmp_path / "checkpoint.pt", restored, ropt)
    assert step == 3 and state == feed_state
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), ropt.state.values(), strict=True):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    nxt = next(batches)
    for m, o in ((model, opt), (restored, ropt)):
        train(m, iter([nxt]), steps=4, grad_accum=1, optimizer=o, log=lambda r: None, start_step=3)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)


STEPS, ACCUM, WORLD = 2, 2, 2


def _ddp_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        records = []
        train(
            DDP(model),
            synthetic_batches(100 + rank),
            steps=STEPS,
            grad_accum=ACCUM,
            optimizer=opt,
            log=records.append,
        )
        torch.save(
            {"params": model.state_dict(), "losses": [r["loss"] for r in records]},
            f"{tmp}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_ranks_stay_identical_and_match_one_process(tmp_path: Path):
    import torch.multiprocessing as mp

    # Fork skips re-importing torch and transformers in each child (~0.5 s instead of ~20 s on
    # two cores); it is only safe while this process runs no other threads (a Ray driver does).
    method = "fork" if threading.active_count() == 1 else "spawn"
    mp.start_processes(_ddp_worker, args=(WORLD, str(tmp_path)), nprocs=WORLD, start_method=method)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    assert r0["losses"] == r1["losses"]
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name

    # One process over each step's 2 ranks x 2 micro-batches, concatenated, gives the same.
    streams = [synthetic_batches(100 + r) for r in range(WORLD)]
    steps = [concat([next(s) for s in streams for _ in range(ACCUM)]) for _ in range(STEPS)]
    single = tiny_model()
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    train(single, iter(steps), steps=STEPS, grad_accum=1, optimizer=opt, log=lambda r: None)
    for name, p in single.state_dict().items():
        torch.testing.assert_close(p, r0["params"][name], atol=1e-5, rtol=0, msg=name)
