"""Train on a tokenmill MDS export with LLM-Foundry (or any MosaicML `streaming` reader)
without losing the loss masks. No llm-foundry import: it plugs in through its registry.

`tokenmill export --format mds` writes one MDS dataset, rows in global order, with the columns
`tokens` (the row's real tokens, for LLM-Foundry's `StreamingTextDataset`), `input_ids`,
`labels`, `position_ids`, `segment_ids` (all [L]), `seq_lens` and `global_step`.

Why not `train_loader.name: text`: LLM-Foundry's `StreamingTextDataset.__getitem__` returns
only `tokens`, and its collator, `transformers.DataCollatorForLanguageModeling(mlm=False)`,
rebuilds `labels` from them with every pad id set to -100. tokenmill's masks are gone then:
chat prompts are trained on, each segment's first token is a target of the previous
document's last one, and where the pad id is the EOS id (the usual choice) no EOS is ever a
target, so the model never learns to stop. It also gives no document boundaries, so attention
crosses documents (MPT can rebuild them from EOS with `dataset.eos_token_id`; HF models not).

`collate` is the fix: it stacks the stored `input_ids` and `labels` as they were served and
derives `position_ids` (restarting at 0 on each segment, which HF models read as document
boundaries when `use_cache` is off; trainer/adapters.py) and, for MPT's
`attn_uses_sequence_id`, `sequence_id` from `seq_lens`. `build_dataloader` is the builder to
register as an LLM-Foundry dataloader (docs/trainers.md has the yaml).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from wire.protocol import IGNORE_LABEL

NEEDED = ("input_ids", "labels", "seq_lens")


def _segments(seq_lens: Sequence[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """position_ids and sequence ids [B, L] from each row's segment lengths.

    Positions restart at 0 on every segment; padding gets position 0 at every token (each pad
    token a sequence of its own for HF's boundary detection). Sequence ids count the row's
    segments from 0; padding gets -1.
    """
    rows = len(seq_lens)
    positions = np.zeros((rows, length), dtype=np.int64)
    sequence = np.full((rows, length), -1, dtype=np.int64)
    for r, lens in enumerate(seq_lens):
        lens = np.asarray(lens, dtype=np.int64)
        real = int(lens.sum())
        starts = np.repeat(np.cumsum(lens) - lens, lens)  # each token's segment start
        positions[r, :real] = np.arange(real) - starts
        sequence[r, :real] = np.repeat(np.arange(len(lens)), lens)
    return positions, sequence


def collate(samples: Sequence[dict], sequence_id: bool = False) -> dict[str, torch.Tensor]:
    """A batch for a causal LM from MDS samples of a tokenmill export.

    Returns `input_ids`, `labels` (the stored ones: -100 on padding, prompts and each
    segment's first token; the model shifts) and `position_ids`, all int64 [B, L]; with
    `sequence_id`, also MPT's `sequence_id`.
    """
    missing = [k for k in NEEDED if k not in samples[0]]
    if missing:
        raise KeyError(
            f"MDS sample has no {missing}: the collator needs a tokenmill MDS export "
            f"(`tokenmill export --format mds`), which has {list(NEEDED)}; got {sorted(samples[0])}"
        )
    ids = np.stack([s["input_ids"] for s in samples]).astype(np.int64)
    labels = np.stack([s["labels"] for s in samples]).astype(np.int64)
    positions, sequence = _segments([s["seq_lens"] for s in samples], ids.shape[1])
    batch = {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
    }
    if sequence_id:
        batch["sequence_id"] = torch.from_numpy(sequence)
    return batch


def build_dataloader(tokenizer, device_batch_size: int, dataset: dict, drop_last: bool = True,
                     num_workers: int = 0, sequence_id: bool = False, pin_memory: bool = True,
                     prefetch_factor: int | None = None, persistent_workers: bool = False,
                     timeout: float = 0, **_ignored):  # fmt: skip
    """An LLM-Foundry dataloader builder: `train_loader:` yaml keys in, a DataLoader out.

    `dataset` holds `streaming.StreamingDataset` arguments (`remote`, `local`, `split`,
    `shuffle`, `shuffle_seed`, ...). The tokenizer is not used: the export is tokenized.
    LLM-Foundry passes the loader's `name` too; it and other unknown keys are ignored.
    Keep `shuffle: false` to train on rows in the exported (served) order.
    """
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    ds = StreamingDataset(batch_size=device_batch_size, **dataset)
    return DataLoader(
        ds,
        batch_size=device_batch_size,
        collate_fn=partial(collate, sequence_id=sequence_id),
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=persistent_workers and num_workers > 0,
        timeout=timeout,
    )


def labelled_tokens(batch: dict) -> int:
    """Tokens that carry a loss (LLM-Foundry/Composer's `get_num_tokens_in_batch`)."""
    return int((batch["labels"] != IGNORE_LABEL).sum())
