"""Packed rows through the model: block-diagonal attention equals running each document alone."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainer.model import (
    IGNORE_INDEX,
    block_causal_mask,
    cu_seqlens,
    forward_packed,
    packed_loss,
    small_llama,
)

VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def _one_thread(torch_one_thread):
    """Tiny models: one intra-op thread (conftest's `torch_one_thread`)."""


def packed_row(lens: list[int], length: int, seed: int = 0) -> dict:
    """One packed row of random documents, laid out as SPEC §3.2 says."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(1, length, dtype=torch.long)
    labels = torch.full((1, length), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros(1, length, dtype=torch.long)
    seg = torch.zeros(1, length, dtype=torch.long)
    start = 0
    for k, n in enumerate(lens):
        doc = torch.randint(1, VOCAB, (n,), generator=g)
        ids[0, start : start + n] = doc
        labels[0, start + 1 : start + n] = doc[1:]
        pos[0, start : start + n] = torch.arange(n)
        seg[0, start : start + n] = k + 1
        start += n
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "segment_ids": seg,
        "seq_lens": [lens],
    }


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return small_llama(vocab_size=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2).eval()


def test_block_causal_mask_small():
    seg = torch.tensor([[1, 1, 2, 2, 0]])
    m = block_causal_mask(seg)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def test_cu_seqlens_from_seq_lens_or_segments():
    seg = torch.tensor([[1, 1, 2, 2, 0], [1, 1, 1, 2, 3]])
    from_lens = cu_seqlens([[2, 2], [3, 1, 1]], seg)
    from_segs = cu_seqlens(None, seg)
    assert from_lens[0].tolist() == from_segs[0].tolist() == [0, 2, 4, 5, 8, 9, 10]
    assert from_lens[1] == from_segs[1] == 3


def test_packed_equals_each_document_alone(model):
    lens, length = [7, 12, 5], 32
    row = packed_row(lens, length)
    with torch.no_grad():
        logits = forward_packed(
            model, row["input_ids"], row["position_ids"], row["segment_ids"], row["seq_lens"]
        )
        start, losses = 0, []
        for n in lens:
            alone = model(input_ids=row["input_ids"][:, start : start + n]).logits
            torch.testing.assert_close(logits[:, start : start + n], alone, atol=1e-4, rtol=0)
            losses.append(packed_loss(alone, row["labels"][:, start : start + n]))
            start += n
        packed, count = packed_loss(logits, row["labels"])
    assert count == sum(n - 1 for n in lens)
    expected = sum(mean * c for mean, c in losses) / count
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    assert torch.isfinite(logits).all()  # padding rows attend to themselves: no NaN


def test_cross_segment_leak_is_detected(model):
    row = packed_row([9, 9, 6], 24, seed=1)
    leaky_segments = (row["segment_ids"] != 0).long()  # one segment: plain causal attention
    with torch.no_grad():
        good = forward_packed(model, row["input_ids"], row["position_ids"], row["segment_ids"])
        leaky = forward_packed(model, row["input_ids"], row["position_ids"], leaky_segments)
    torch.testing.assert_close(good[:, :9], leaky[:, :9], atol=1e-5, rtol=0)  # first doc alike
    assert (good[:, 9:24] - leaky[:, 9:24]).abs().max() > 1e-3
    assert abs(packed_loss(good, row["labels"])[0] - packed_loss(leaky, row["labels"])[0]) > 1e-4


def test_packed_loss_shift_and_ignore():
    logits = torch.zeros(1, 4, 3)
    logits[0, 0, 2] = 10.0  # position 0 predicts label[1] = 2, confidently right
    labels = torch.tensor([[IGNORE_INDEX, 2, 1, IGNORE_INDEX]])
    mean, count = packed_loss(logits, labels)
    assert count == 2
    expected = (torch.log1p(2 * torch.exp(torch.tensor(-10.0))) + torch.log(torch.tensor(3.0))) / 2
    torch.testing.assert_close(mean, expected)
    empty, zero = packed_loss(logits, torch.full((1, 4), IGNORE_INDEX))
    assert zero == 0 and float(empty) == 0.0


def _reference_varlen(module, q, k, v, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stands in for flash_attn_varlen_func on CPU: causal SDPA per cu_seq_lens_q sequence."""
    assert attention_mask is None and q.shape[0] == 1  # flattened, mask-free
    cu = kwargs["cu_seq_lens_q"].tolist()
    assert kwargs["max_length_q"] == max(b - a for a, b in itertools.pairwise(cu))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = [
        F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scaling
        )
        for a, b in itertools.pairwise(cu)
    ]
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("from_seq_lens", [True, False])
def test_varlen_path_plumbing_on_cpu(monkeypatch, from_seq_lens):
    """The flash path's flattening and cu_seqlens reach HF attention and give the SDPA logits.

    The kernel is a CPU stand-in; the real flash_attn kernel is checked by the GPU test.
    """
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", _reference_varlen
    )
    torch.manual_seed(0)
    model = small_llama(vocab_size=VOCAB, hidden=64, attn_implementation="sdpa").eval()
    rows = [packed_row([7, 12, 5], 32, seed=0), packed_row([16, 16], 32, seed=1)]
    batch = {
        k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "position_ids", "segment_ids")
    }
    seq_lens = [r["seq_lens"][0] for r in rows] if from_seq_lens else None
    with torch.no_grad():
        sdpa = forward_packed(model, **batch)
        monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
        varlen = forward_packed(model, **batch, seq_lens=seq_lens)
    torch.testing.assert_close(varlen, sdpa, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_flash_varlen_matches_sdpa():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    sdpa = small_llama(vocab_size=VOCAB, hidden=128, attn_implementation="sdpa")
    flash = small_llama(vocab_size=VOCAB, hidden=128, attn_implementation="flash_attention_2")
    flash.load_state_dict(sdpa.state_dict())
    rows = [packed_row([30, 50, 20], 128, seed=s) for s in (0, 1)]
    rows[1] = packed_row([64, 64], 128, seed=1)
    batch = {
        k: torch.cat([r[k] for r in rows]).cuda()
        for k in ("input_ids", "labels", "position_ids", "segment_ids")
    }
    seq_lens = [r["seq_lens"][0] for r in rows]
    out = {}
    for name, m, lens in (
        ("sdpa", sdpa, seq_lens),
        ("flash", flash, seq_lens),
        ("flash_from_segments", flash, None),
    ):
        m.cuda().eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward_packed(
                m, batch["input_ids"], batch["position_ids"], batch["segment_ids"], lens
            )
            out[name] = packed_loss(logits, batch["labels"])
    for name in ("flash", "flash_from_segments"):
        assert out[name][1] == out["sdpa"][1]
        torch.testing.assert_close(out[name][0], out["sdpa"][0], atol=2e-2, rtol=0)
