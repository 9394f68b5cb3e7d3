"""What the HF check costs the fast engine, by document size.

    python -m bench verify-cost [--sizes 10000,100000,300000,1200000] [--repeats 3]

`auto` encodes with the fast engine and checks a sample of every batch (`verify_fraction`,
1% of the characters by default) against the HF tokenizer (pipeline/tokenize/encoders.py
`verify_sample`). This bench cuts the demo corpus's code.jsonl into documents of each size
and encodes them as a read does (`reading._encode_pretrain`: batches of ~1 MiB, each checked),
against the fast engine alone on the same documents, in the same process: the ratio is the
share of the fast engine's rate that survives the check. Best of `repeats` each.

A long document used to be checked whole when no text of its batch fit the budget; now a
window of it is. The ratio should not fall with the document size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def rates(docs: list[str], tok, repeats: int) -> tuple[float, float]:
    """(verified path, fast alone) tokens/s on `docs`, best of `repeats`."""
    from pipeline.read.reading import _encode_pretrain

    assert tok.fast is not None, "no fast engine for the default tokenizer"
    best_v = best_f = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        n = sum(len(flat) for flat, *_ in _encode_pretrain(docs, tok))
        best_v = max(best_v, n / (time.perf_counter() - t))
        t = time.perf_counter()
        m = len(tok.fast.encode_flat(docs)[0])
        best_f = max(best_f, m / (time.perf_counter() - t))
    return best_v, best_f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench verify-cost", description=__doc__)
    ap.add_argument("--sizes", default="10000,100000,300000,1200000")
    ap.add_argument("--total", type=int, default=6_000_000, help="characters per size")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer
    from service.demo_corpus import build_demo_corpus

    tok = load_tokenizer(TokenizerConfig())
    with open(build_demo_corpus() / "code.jsonl") as f:
        blob = "".join(json.loads(line)["text"] for line in f)
    print(f"{'document chars':>15}{'verified tok/s':>16}{'fast alone':>14}{'ratio':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        docs = [blob[i : i + size] for i in range(0, min(args.total, len(blob)), size)]
        v, f = rates(docs, tok, args.repeats)
        print(f"{size:>15,}{v:>16,.0f}{f:>14,.0f}{v / f:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
