"""The model config and packed-row attention for the thin trainer.

The model is a small Llama-architecture causal LM built from a `LlamaConfig`, so nothing is
downloaded. A served row packs several documents (docs/architecture.md, "Batch schema"): `position_ids` restart at every
segment and `segment_ids` are 1..k on the segments and 0 on padding. Attention must not cross
a segment boundary, and there are two ways to enforce that:

- **Flash varlen** (CUDA with `flash_attn` importable, `attn_implementation="flash_attention_2"`).
  The [B, L] batch is flattened to [1, B*L] and HF Llama is given `cu_seq_lens_q/k` and
  `max_length_q/k`, which it hands straight to `flash_attn_varlen_func`. The cumulative
  lengths come from `seq_lens` (each row's padding tail counts as one more sequence), so no
  mask is materialised and the cost is linear in the real lengths.
- **SDPA with a block-diagonal causal mask** (everywhere else). `block_causal_mask` builds a
  [B, 1, L, L] boolean mask from `segment_ids` and it is passed as `attention_mask`. In
  transformers 4.57 a 4D mask skips HF's own mask construction (`_preprocess_mask_arguments`
  returns it as-is) and `sdpa_attention_forward` hands it to
  `torch.nn.functional.scaled_dot_product_attention` with `is_causal=False`. A boolean mask
  (True = may attend) is used rather than an additive float one because SDPA then accepts it
  whatever the query dtype is under autocast; for the `eager` implementation, which adds the
  mask to the scores, it is converted to 0 / dtype-min. The trade-off: the mask costs
  B*L*L bytes (8 MiB for B=8, L=1024) and SDPA cannot use its flash kernel with a custom mask,
  so the CPU/fallback path spends O(L^2) on masked-out blocks.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from wire.protocol import IGNORE_LABEL

IGNORE_INDEX = IGNORE_LABEL  # the labels of padding, prompts and first tokens


def flash_available() -> bool:
    """True when the varlen flash-attention path can run here."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def small_llama(
    vocab_size: int = 100_277,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 1024,
    attn_implementation: str | None = None,
) -> LlamaForCausalLM:
    """A small Llama causal LM from a config (no download).

    `attn_implementation` defaults to `flash_attention_2` where `flash_available()` and to
    `sdpa` otherwise; `forward_packed` picks its packing path from it.
    """
    if attn_implementation is None:
        attn_implementation = "flash_attention_2" if flash_available() else "sdpa"
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config)


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, L, L] mask: token i may attend to j iff j <= i and both share a segment.

    Padding (segment 0) attends only to itself, so no softmax row is empty and no NaN appears;
    padding never carries a label, so what it computes does not matter.
    """
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril_()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    diagonal = torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    return ((same & real & causal) | diagonal).unsqueeze(1)


def cu_seqlens(
    seq_lens: list[list[int]] | None, segment_ids: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Cumulative sequence lengths over the flattened [B*L] batch, and the longest sequence.

    Each row's padding tail is one more sequence, so the offsets cover every position.
    Without `seq_lens` the boundaries are read from `segment_ids` (this costs a device sync).
    """
    batch, length = segment_ids.shape
    if seq_lens is not None:
        lens = []
        for row in seq_lens:
            lens.extend(row)
            if sum(row) < length:
                lens.append(length - sum(row))
        cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum_(0, dtype=torch.int32)
        return cu.to(segment_ids.device, non_blocking=True), max(lens)
    flat = segment_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::length] = True
    bounds = torch.nonzero(starts).flatten()
    end = torch.tensor([flat.numel()], device=flat.device)
    cu = torch.cat([bounds, end]).to(torch.int32)
    return cu, int(cu.diff().max())


def forward_packed(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    seq_lens: list[list[int]] | None = None,
) -> torch.Tensor:
    """Logits [B, L, V] for packed rows, with no attention across segments.

    `model` may be wrapped (DDP); the path follows the wrapped model's attention
    implementation, as described in the module docstring.
    """
    impl = getattr(model, "module", model).config._attn_implementation
    batch, length = input_ids.shape
    if impl == "flash_attention_2":
        cu, longest = cu_seqlens(seq_lens, segment_ids)
        out = model(
            input_ids=input_ids.reshape(1, -1),
            position_ids=position_ids.reshape(1, -1),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )
        return out.logits.view(batch, length, -1)
    mask = block_causal_mask(segment_ids)
    if impl == "eager":
        dtype = getattr(model, "module", model).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
    elif impl != "sdpa":
        raise ValueError(
            f"forward_packed: attn_implementation {impl!r} is not supported; "
            "use 'flash_attention_2', 'sdpa' or 'eager'"
        )
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask).logits


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross entropy, HF convention, [B, L - 1]: entry t is the loss of
    predicting labels[:, t + 1] from logits[:, t]; 0 where that label is -100."""
    B, L = labels.shape
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).reshape(B, L - 1)


def packed_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Next-token cross entropy, HF convention: labels align with input_ids, shift inside.

    logits[:, t] predicts labels[:, t + 1]; -100 is ignored. Returns the mean over labelled
    tokens (0 when there are none) and their count.
    """
    count = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return token_losses(logits, labels).sum() / max(count, 1), count
