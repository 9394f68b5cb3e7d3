"""Loss per stream: the one-call helper equals a hand computation, the service joins the ranks'
reports per step, and HF's Trainer (FeedTrainer) and the torchrun trainer report it."""

import math
import os
import time

import pytest
import ray
import torch

from service.losses import StreamLosses
from tests.rayhead import patient
from trainer.feed import stream_loss


def test_stream_loss_of_a_known_batch_equals_a_hand_computation():
    # Two rows of 6: row 0 = web(3) + code(2) + pad; row 1 = code(6). First labels are -100.
    labels = torch.tensor([[-100, 5, 6, -100, 8, -100], [-100, 1, 2, -100, 4, 5]])
    batch = {"labels": labels, "seq_lens": [[3, 2], [6]], "stream": [["web", "code"], ["code"]]}
    shifted = torch.arange(1.0, 11.0).reshape(2, 5)  # loss of predicting labels[:, t + 1]
    got = stream_loss(batch, shifted)
    # web: labels at (0,1), (0,2) -> shifted (0,0)=1, (0,1)=2. code: (0,4) -> 4; row 1:
    # (1,1), (1,2), (1,4), (1,5) -> 6, 7, 9, 10.
    assert got == {"web": [3.0, 2], "code": [36.0, 5]}
    aligned = torch.nn.functional.pad(shifted, (1, 0))
    assert stream_loss(batch, aligned) == got
    with pytest.raises(ValueError, match="shape"):
        stream_loss(batch, torch.zeros(2, 3))


def test_reports_are_joined_per_step_over_the_ranks():
    agg = StreamLosses(["web", "code"], window=2)
    agg.add(0, 2, 0, {"web": [2.0, 1], "code": [6.0, 2]})
    assert agg.mean(0, 1) is None  # rank 1 has not reported step 0
    agg.add(1, 2, 0, {"web": [4.0, 1]})
    agg.add(1, 2, 0, {"web": [400.0, 1]})  # a repeat is counted once
    assert agg.mean(0, 1) == {"web": 3.0, "code": 3.0}
    for rank in (0, 1):
        agg.add(rank, 2, 1, {"web": [1.0, 1]})
    view = agg.view()
    assert view["streams"]["web"] == {"loss": 8.0 / 4, "tokens": 4.0, "steps": 2}
    assert [h["step"] for h in view["history"]] == [0, 1]
    for bad in ({"nope": [1, 1]}, {"web": [math.nan, 1]}, {"web": [-1.0, 1]}, {"web": "x"}):
        with pytest.raises(ValueError):
            agg.add(0, 2, 2, bad)


def test_a_steps_loss_sums_are_the_same_bits_for_every_world_size():
    """The mixing policy decides from each step's loss sums over the world. With identical
    per-token losses, 1, 2, 4 and 8 ranks (each summing its own rows, reports joined in any
    order) give bit-identical sums, so the decisions cannot depend on the world size."""
    gen = torch.Generator().manual_seed(7)
    G, L = 8, 64
    labels = torch.randint(0, 1000, (G, L), generator=gen)
    labels[:, 0] = -100
    streams = [["a", "b"] if r % 2 else ["b"] for r in range(G)]
    lens = [[40, 24] if r % 2 else [L] for r in range(G)]
    for r in range(G):
        if r % 2:
            labels[r, 40] = -100  # a segment's first label
    loss = torch.rand(G, L - 1, generator=gen, dtype=torch.float32) * 12
    joined = {}
    for world in (1, 2, 4, 8):
        agg = StreamLosses(["a", "b"])
        per = G // world
        for rank in reversed(range(world)):  # reports arrive in any order
            rows = slice(rank * per, (rank + 1) * per)
            batch = {"labels": labels[rows], "seq_lens": lens[rows], "stream": streams[rows]}
            agg.add(rank, world, 0, stream_loss(batch, loss[rows]))
        joined[world] = agg.sums(0)
    assert joined[1] is not None and joined[1]["a"][1] > 0
    assert all(joined[w] == joined[1] for w in (2, 4, 8)), joined


@pytest.mark.slow
def test_hf_trainer_reports_loss_per_stream_that_adds_up_to_its_loss(ray_cluster, tmp_path):
    from transformers import TrainingArguments

    from pipeline.read.resolve import parse_config
    from service.serve import start_server
    from tests.conftest import stdlib_texts, write_jsonl
    from tests.test_adapters import LENGTH, TOKENIZER_VOCAB, tiny_llama
    from trainer.adapters import FeedDataset, FeedTrainer

    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(12, max_bytes=2000))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(12, start=30, max_bytes=2000))
    cfg = parse_config({"seed": 5, "seq_len": LENGTH, "global_batch_size": 2, "shuffle": {"window": 4},
                        "streams": {"web": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.5},
                                    "code": {"paths": [str(tmp_path / "b.jsonl")], "weight": 0.5}}})  # fmt: skip
    name = f"loss{os.getpid()}"
    actor = start_server(cfg, name=name, prefetch=4)
    try:
        args = TrainingArguments(
            output_dir=str(tmp_path / "o"), max_steps=4, learning_rate=1e-3, logging_steps=1,
            save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
            dataloader_pin_memory=False,
        )  # fmt: skip
        trainer = FeedTrainer(model=tiny_llama(TOKENIZER_VOCAB), args=args,
                              train_dataset=FeedDataset(service=name, stream_loss=True))  # fmt: skip
        trainer.train()
        deadline = time.time() + patient(30)
        while True:  # the reports are fire and forget: the last may still be on its way
            view = ray.get(actor.metrics.remote())["stream_loss"]
            if len(view["history"]) == 4 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert [h["step"] for h in view["history"]] == [0, 1, 2, 3]
        assert set(view["streams"]) == {"web", "code"}
        assert all(v["loss"] is not None and v["tokens"] > 0 for v in view["streams"].values())
        # Per step, the streams' losses weighted by their tokens are the loss HF logged (its
        # step n + 1 trained on global step n, world 1, no accumulation).
        logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        for h in view["history"]:
            total = sum(h["loss"][n] * h["tokens"][n] for n in h["loss"] if h["tokens"][n])
            mean = total / sum(h["tokens"].values())
            assert mean == pytest.approx(logged[h["step"] + 1], rel=1e-4), h
    finally:
        ray_cluster.kill(actor)
