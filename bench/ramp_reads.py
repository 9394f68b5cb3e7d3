"""What the first epoch's reads ask before each draw: the ramp's pieces whole, or in parts.

    python -m bench ramp-reads [--corpus site-packages:128] [--seeds 0,1,2] [--parts 1,5]
        [--draws 50,100,200,300,512,800,1500]

For each seed and each `read.ramp_parts`, the plan of epoch 0 (pipeline/stages/plan.py: the
units, their pieces or parts, in reading order) and the interleave's real draws
(shuffle.Interleave, with every piece's and part's row count, read but not tokenized). At each
listed draw it prints the input bytes (MiB) that had to be read, in reading order, for the
draws up to it: what the head start must have tokenized by then, so the first steps' wait
follows from it and the tokenizer's rate. Deterministic: no timing, no Ray.
"""

from __future__ import annotations

import argparse
import collections
import sys

from bench.corpora import resolve_corpus


def reads_before(corpus: str, seed: int, parts: int, draws: list[int]) -> list[float]:
    """MiB read (piece and part bytes, reading order) by each of `draws`."""
    from pipeline.read.resolve import parse_config
    from pipeline.read.sources import read_piece
    from pipeline.stages.plan import StreamPlan
    from pipeline.stages.shuffle import Interleave

    cfg = parse_config({"seed": seed, "read": {"ramp_parts": parts},
                        "streams": {"s": {"paths": [corpus]}}})  # fmt: skip
    plan = StreamPlan("s", cfg)
    units, ords = plan.plan(0, (), 0)
    stream = []  # (ordinal, rows, MiB read once it is)
    read = 0.0
    for unit, unit_ords in zip(units, ords, strict=True):
        for piece, ordinal in zip(unit.pieces, unit_ords, strict=True):
            read += piece.nbytes / 2**20
            stream.append((ordinal, sum(1 for _ in read_piece(piece, "text")), read))
    left = collections.Counter(o for o, _, _ in stream)  # parts not yet read, per piece
    il = Interleave(cfg.shuffle.pieces, seed, plan.salt, 0, len(plan.order(0)[0]))
    ready: dict[int, int] = {}
    at = 0

    def rows_of(ordinal: int) -> tuple[int, bool]:
        nonlocal at
        while ordinal not in ready:
            o, rows, _ = stream[at]
            at += 1
            ready[o] = ready.get(o, 0) + rows
            left[o] -= 1
        return ready.pop(ordinal), left[ordinal] > 0

    out = []
    for d in range(max(draws) + 1):
        want = il.to_open()
        while want is not None:
            rows, more = rows_of(want)
            while more and not rows:
                extra, more = rows_of(want)
                rows += extra
            il.opened(want, rows, more)
            want = il.to_open()
        if il.finished:
            break
        while (need := il.needs()) is not None:
            il.extended(need, *rows_of(need))
        if d in draws:
            out.append(stream[at - 1][2] if at else 0.0)
        il.draw()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench ramp-reads",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--corpus", default="site-packages:128", help="a JSONL file, or "
                    "site-packages[:MB] (bench/corpora.py), or 'demo'")  # fmt: skip
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--parts", default="1,5", help="read.ramp_parts values (1: whole pieces)")
    ap.add_argument("--draws", default="50,100,200,300,512,800,1500")
    args = ap.parse_args(argv)
    corpus = str(resolve_corpus(None if args.corpus == "demo" else args.corpus))
    draws = [int(d) for d in args.draws.split(",")]
    print(f"MiB read before draw ({corpus})")
    print(f"{'seed':>4} {'parts':>5} " + " ".join(f"{d:>6}" for d in draws))
    for seed in (int(s) for s in args.seeds.split(",")):
        for parts in (int(p) for p in args.parts.split(",")):
            mib = reads_before(corpus, seed, parts, draws)
            print(f"{seed:>4} {parts:>5} " + " ".join(f"{m:>6.1f}" for m in mib), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
