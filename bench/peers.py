"""Peer baselines for `tokenmill bench`: the same job done the way others do it.

Each peer reads a JSONL corpus (`{"text": ...}` per line), tokenizes every document with
tokenmill's default tokenizer (cl100k_base converted to a HF `tokenizer.json`), appends
`<|endoftext|>` as tokenmill does (`add_eos`), and delivers packed rows of at most `L` tokens to
the caller. Each returns ``{"tokens", "rows", "elapsed_s"}``: `tokens` counts only real tokens in
delivered rows (never padding), and `elapsed_s` runs from the first line of the peer's code to
the last row received, start-up included, as tokenmill's end-to-end figure does.

Every process tokenizes on one thread (`RAYON_NUM_THREADS=1`, `TOKENIZERS_PARALLELISM=false`),
so N processes use N cores, as tokenmill's Ray workers do. The peers are written the way a
competent user would write them (batched encoding, Arrow or numpy hand-off, no per-token
Python loops), not as straw men: the comparison is only worth something if the peers are fair.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"


def _one_thread() -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tokenizer_file() -> str:
    from pipeline.tokenize.engines import default_tokenizer_file

    return str(default_tokenizer_file())


def _encode_flat(tok, eos: int, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Batch-encode `texts`; return (flat int32 ids with EOS after each doc, int32 offsets)."""
    fast = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    ids = [e.ids for e in fast(texts, add_special_tokens=False)]
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum([len(x) + 1 for x in ids], out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    for i, x in enumerate(ids):
        flat[offsets[i] : offsets[i + 1] - 1] = x
    flat[offsets[1:] - 1] = eos
    return flat, offsets


class ConcatPacker:
    """Greedy concatenation into rows of exactly `L` tokens (the last row may be short).

    Documents are laid end to end and cut at every `L` tokens, so every row but the last is
    full and no token is lost; a document crossing a boundary continues in the next row. This
    is the cheapest packer there is (one `np.concatenate` and a reshape per input batch),
    which favours the peers that use it.
    """

    def __init__(self, L: int):
        self.L = L
        self._held: list[np.ndarray] = []
        self._n = 0

    def add(self, flat: np.ndarray) -> np.ndarray:
        """Take a batch of token ids; return the full rows now complete, shape (k, L)."""
        self._held.append(flat)
        self._n += len(flat)
        if self._n < self.L:
            return np.empty((0, self.L), dtype=np.int32)
        cat = np.concatenate(self._held)
        k = len(cat) // self.L
        rest = cat[k * self.L :]
        self._held, self._n = [rest], len(rest)
        return cat[: k * self.L].reshape(k, self.L)

    def finish(self) -> np.ndarray:
        """The last, partial row (possibly empty)."""
        rest = np.concatenate(self._held) if self._held else np.empty(0, dtype=np.int32)
        self._held, self._n = [], 0
        return rest


def hf_datasets_trl(jsonl_path, L: int, num_proc: int, strategy: str = "bfd_split") -> dict:
    """HF `datasets.map(num_proc=N, batched=True)` tokenization, then TRL's `pack_dataset`.

    This is the SFT recipe of TRL's `SFTTrainer` (`dataset_num_proc`, `packing=True`,
    `packing_strategy="bfd"`): `load_dataset("json")` converts the JSONL to an Arrow cache,
    `map` tokenizes contiguous shards in N processes with `PreTrainedTokenizerFast` and
    writes the ids back to Arrow, and `trl.pack_dataset` runs best-fit-decreasing over each
    `map` batch of 1,000 sequences, again in N processes. Rows are variable-length (≤ L, no
    padding: TRL pads in the collator) and are delivered by iterating the packed dataset in
    Arrow format.

    `strategy` defaults to `"bfd_split"`, TRL's BFD variant that splits documents longer than
    `L` into pieces, which is what tokenmill's `bfd` does (`overflow: split`). Plain `"bfd"`
    truncates them and discards the rest: on source files, most of whose tokens lie in
    documents longer than 2,048 tokens, it would tokenize everything and deliver a fraction,
    which measures a configuration choice rather than the pipeline.

    Every call gets a fresh cache directory, so no repeat reuses an earlier one's Arrow files
    (`datasets` fingerprints `map` and would otherwise skip the work).
    """
    _one_thread()
    import datasets
    import pyarrow.compute as pc
    from transformers import PreTrainedTokenizerFast
    from trl import pack_dataset

    datasets.disable_progress_bars()
    start = time.perf_counter()  # after the imports, as for every method: they are not work
    tok = PreTrainedTokenizerFast(tokenizer_file=_tokenizer_file(), eos_token=EOS)
    eos = tok.eos_token_id

    def tokenize(batch):
        enc = tok(batch["text"], add_special_tokens=False, return_attention_mask=False)
        return {"input_ids": [ids + [eos] for ids in enc["input_ids"]]}

    tokens = rows = 0
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-hf-") as cache:
        ds = datasets.load_dataset(
            "json", data_files=str(jsonl_path), split="train", cache_dir=cache
        )
        ds = ds.map(
            tokenize,
            batched=True,
            num_proc=num_proc,
            remove_columns=ds.column_names,
            load_from_cache_file=False,
        )
        ds = pack_dataset(
            ds,
            L,
            strategy=strategy,
            map_kwargs={"num_proc": num_proc, "load_from_cache_file": False},
        )
        for table in ds.with_format("arrow").iter(batch_size=1024):
            tokens += int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0)
            rows += table.num_rows
        elapsed = time.perf_counter() - start
    return {"tokens": tokens, "rows": rows, "elapsed_s": elapsed, "strategy": strategy}


class _RayTokenize:
    """Ray Data actor: loads the tokenizer once, turns a batch of texts into a list column."""

    def __init__(self, tokenizer_file: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_file)
        self.eos = self.tok.token_to_id(EOS)

    def __call__(self, batch):
        import pyarrow as pa

        flat, offsets = _encode_flat(self.tok, self.eos, batch.column("text").to_pylist())
        return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))})


def naive_ray_data(jsonl_path, L: int, n: int, batch_size: int = 64) -> dict:
    """A plain Ray Data pipeline: `read_json` → actor-pool `map_batches` → pack in the driver.

    This is the pattern of Ray's own LLM batch-inference and preprocessing examples: read the
    files with `ray.data.read_json`, tokenize in `map_batches` with a callable class on a pool of
    `n` actors (`concurrency=n`, so each loads the tokenizer once), hand batches over as Arrow
    list columns, and pack with greedy concatenation (`ConcatPacker`) in the driver while
    iterating `iter_batches`. It has no mixing, shuffling, checkpointing or feed actor: that is
    what makes it naive, and also what makes it a fair bar for the plumbing cost tokenmill adds.

    Ray must already be initialized (the suite connects once, with one tokenizer thread per
    worker). The actors reserve one CPU each; with `n` equal to the CPU count that is every
    slot, so the read is declared with `num_cpus=0` (reading is light next to tokenizing).
    Start-up (actor creation, each loading the tokenizer) is part of the figure.
    """
    _one_thread()
    import pyarrow.compute as pc
    import ray

    if not ray.is_initialized():
        raise RuntimeError("naive_ray_data: connect to Ray first (client.cluster.connect())")
    start = time.perf_counter()
    # The read takes no CPU slot: with `n` actors holding every slot, a read task that needs
    # one is never scheduled and the pipeline deadlocks (Ray Data backpressures it forever).
    ds = ray.data.read_json(str(jsonl_path), lines=True, num_cpus=0).select_columns(["text"])
    ds = ds.map_batches(
        _RayTokenize,
        fn_constructor_args=(_tokenizer_file(),),
        batch_size=batch_size,
        batch_format="pyarrow",
        concurrency=n,
        num_cpus=1,
    )
    packer = ConcatPacker(L)
    tokens = rows = 0
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        flat = pc.list_flatten(batch.column("input_ids")).to_numpy()
        full = packer.add(flat)
        tokens += full.size
        rows += len(full)
    last = packer.finish()
    if len(last):
        tokens += len(last)
        rows += 1
    return {"tokens": tokens, "rows": rows, "elapsed_s": time.perf_counter() - start}


@functools.cache
def _packed_jsonl_class():
    """The torch dataset class, built on first use: importing torch at module level would make
    every Ray Data actor (which imports this module to find `_RayTokenize`) import it too."""
    import torch
    from torch.utils.data import IterableDataset, get_worker_info

    class PackedJsonl(IterableDataset):
        """Each DataLoader worker reads every `num_workers`-th line, tokenizes, packs."""

        def __init__(self, path: str, L: int, tokenizer_file: str, docs_per_encode: int):
            self.path, self.L, self.tokenizer_file = path, L, tokenizer_file
            self.docs_per_encode = docs_per_encode

        def __iter__(self):
            from tokenizers import Tokenizer

            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            tok = Tokenizer.from_file(self.tokenizer_file)
            eos = tok.token_to_id(EOS)
            packer = ConcatPacker(self.L)
            texts = []
            with open(self.path) as f:
                for i, line in enumerate(f):
                    if i % nw != wid:
                        continue
                    texts.append(json.loads(line)["text"])
                    if len(texts) == self.docs_per_encode:
                        yield from self._rows(packer.add(_encode_flat(tok, eos, texts)[0]))
                        texts = []
            if texts:
                yield from self._rows(packer.add(_encode_flat(tok, eos, texts)[0]))
            last = packer.finish()
            if len(last):
                row = np.full(self.L, eos, dtype=np.int32)
                row[: len(last)] = last
                yield {"input_ids": torch.from_numpy(row), "real": len(last)}

        def _rows(self, full: np.ndarray):
            for row in full:
                yield {"input_ids": torch.from_numpy(row), "real": self.L}

    return PackedJsonl


def torch_dataloader(
    jsonl_path, L: int, num_workers: int, batch_size: int = 16, docs_per_encode: int = 64
) -> dict:
    """A torch `DataLoader(num_workers=N)` over an `IterableDataset` that tokenizes and packs.

    The streaming-packing style of ms-swift (`IterablePackingDataset` in
    `swift/llm/dataset/utils.py`, `--streaming true --packing true`) and of many training
    scripts: each worker process takes its shard of the stream (here every N-th line of the
    JSONL, so the shards are balanced), encodes `docs_per_encode` documents at a time, packs
    them into rows of `L` by concatenation (`ConcatPacker`; ms-swift bin-packs a buffer
    instead, which costs more), and the DataLoader collates `batch_size` rows into a tensor
    that travels to the main process through shared memory. Each worker's last row is padded
    with EOS; its `real` count excludes the padding.

    Workers are forked (the Linux default), so start-up is cheap; with `spawn` each worker
    would first import torch again.
    """
    _one_thread()
    from torch.utils.data import DataLoader

    start = time.perf_counter()
    ds = _packed_jsonl_class()(str(Path(jsonl_path)), L, _tokenizer_file(), docs_per_encode)
    loader = DataLoader(ds, batch_size=batch_size, num_workers=num_workers)
    tokens = rows = 0
    for batch in loader:
        tokens += int(batch["real"].sum())
        rows += len(batch["real"])
    return {"tokens": tokens, "rows": rows, "elapsed_s": time.perf_counter() - start}
