"""LLM-Foundry on a tokenmill MDS export: the collator keeps the served labels and positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.read.reading import iter_blocks_local
from service.export import run_export
from tests.test_exports import _config
from tests.test_pretokenized import _corpus
from trainer.llmfoundry import build_dataloader, collate, labelled_tokens
from wire.layout import read_step

G = 4  # global_batch_size of tests/test_exports.py's config


@pytest.fixture(autouse=True, scope="module")
def _one_thread(torch_one_thread):
    """Tiny models: one intra-op thread (conftest's `torch_one_thread`)."""


def test_collated_mds_export_is_the_served_batches(tmp_path, tokenizer):
    from streaming import StreamingDataset

    cfg = _config(_corpus(tmp_path), chat=True)
    run_export(cfg, tmp_path / "mds", executor=iter_blocks_local, fmt="mds", steps=4)
    run_export(cfg, tmp_path / "pq", executor=iter_blocks_local, layout="full", steps=4)
    served = [read_step(p) for p in sorted((tmp_path / "pq").glob("step-*.parquet"))]
    assert len(served) == 4

    ds = StreamingDataset(local=str(tmp_path / "mds" / "mds"), shuffle=False, batch_size=G)
    samples = [ds[i] for i in range(ds.num_samples)]
    assert len(samples) == 4 * G
    for step, want in enumerate(served):
        got = collate(samples[step * G : (step + 1) * G], sequence_id=True)
        assert set(got) == {"input_ids", "labels", "position_ids", "sequence_id"}
        for key in ("input_ids", "labels", "position_ids"):
            expect = np.array(want.column(key).to_pylist(), dtype=np.int64)
            assert got[key].dtype == torch.int64 and np.array_equal(got[key].numpy(), expect), key
        segments = np.array(want.column("segment_ids").to_pylist())
        assert np.array_equal(got["sequence_id"].numpy(), segments - 1)

    # What LLM-Foundry's `text` loader would train on instead: labels = tokens, pad (= EOS) and
    # nothing else masked. The export's labels keep EOS targets and mask the chat prompts.
    eos = tokenizer.eos_id
    assert tokenizer.pad_id == eos
    batch = collate(samples)
    naive = batch["input_ids"].masked_fill(batch["input_ids"] == eos, -100)
    assert int((batch["labels"] == eos).sum()) > 0 and int((naive == eos).sum()) == 0
    prompt = (batch["labels"] == -100) & (naive != -100)
    assert int(prompt.sum()) > 0 and labelled_tokens(batch) < int((naive != -100).sum())


def test_llmfoundry_builder_feeds_an_hf_llama(tmp_path):
    from tests.test_adapters import TOKENIZER_VOCAB, tiny_llama
    from trainer.adapters import prepare_packed

    cfg = _config(_corpus(tmp_path), chat=False)
    run_export(cfg, tmp_path / "o", executor=iter_blocks_local, fmt="mds", steps=2)
    # The yaml `train_loader:` block, as LLM-Foundry hands it to a registered builder.
    loader = build_dataloader(tokenizer=None, device_batch_size=G, name="tokenmill",
                              dataset={"local": str(tmp_path / "o" / "mds"), "shuffle": False},
                              drop_last=True, num_workers=0, pin_memory=False)  # fmt: skip
    batches = list(loader)
    assert len(batches) == 2 and all(b["input_ids"].shape == (G, 256) for b in batches)
    model = tiny_llama(TOKENIZER_VOCAB)
    prepare_packed(model)
    loss = model(**batches[0]).loss
    assert torch.isfinite(loss) and loss > 0
    with pytest.raises(KeyError, match="tokenmill MDS export"):
        collate([{"tokens": np.arange(3)}])
