"""A lane's reading: one lane's documents as fast as its reads deliver them.

    python -m bench.lane_reading [--lanes 1,8,16] [--tokens 20e6] [--repeats 3] [--json PATH]

Lane 0 of K over the demo corpus's code.jsonl (11 MiB) read many times, through Ray Data
tasks on this machine's Ray, as a feed of one lane reads and as lanes read with
`read.in_lanes: false` (by default a lane reads its share in its own process, where an epoch
costs no execution), without mixing, packing or serving: the share of one lane is 1/K of the
file, so with K = 16 an epoch is ~0.7 MiB and one read task.
Two ways, alternating, in the same run:

- chained: epochs several to an execution (pipeline/read/chain.py, the default);
- per epoch: one execution per epoch, the next started when one begins
  (`chain.CHAIN_BLOCKS = 0`, how every stream was read before chains).

Printed: tokens/s over `--tokens` tokens after the first document (the median of `repeats`),
the executions each way started, and the ratio. The absolute rates are this machine's; what
it shows is what a small epoch costs a lane when each is an execution of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml


def lane_rate(cfg, tokens: int) -> tuple[float, int, int]:
    """Lane 0's documents for `tokens` tokens: (tokens/s, executions started, epochs)."""
    from pipeline.read.reading import iter_blocks_ray
    from pipeline.stages.documents import DocSource

    calls = []

    def executor(units, stream, tok):
        calls.append(len(units))
        return iter_blocks_ray(units, stream, tok)

    source = DocSource("code", 0, cfg, executor, lane=0 if cfg.lanes > 1 else None)
    source.start()
    t = n0 = None
    try:
        for _ in source:
            if t is None:
                t, n0 = time.perf_counter(), source.counters.tokens
            if source.counters.tokens - n0 >= tokens:
                break
        rate = (source.counters.tokens - n0) / (time.perf_counter() - t)
        return rate, len(calls), source.pos.epoch
    finally:
        source.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", default="1,8,16", help="comma-separated K (lane 0 of K is read)")
    ap.add_argument("--tokens", type=float, default=20e6, help="tokens read per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import pipeline.read.chain as chain
    from client.cluster import connect
    from pipeline.read.resolve import load_config
    from service.demo_corpus import build_demo_corpus

    corpus = build_demo_corpus() / "code.jsonl"
    connect()
    work = Path(tempfile.mkdtemp(prefix="bench-lane-reading-"))
    rows = []
    default = chain.CHAIN_BLOCKS
    for k in [int(x) for x in args.lanes.split(",")]:
        path = work / f"lanes-{k}.yaml"
        path.write_text(yaml.safe_dump({
            "seq_len": 2048, "global_batch_size": 32, "lanes": k,
            "streams": {"code": {"paths": [str(corpus)], "repeat": 100_000}},
        }))  # fmt: skip
        cfg = load_config(path)
        got: dict[str, list] = {"chained": [], "per epoch": []}
        for _ in range(args.repeats):
            for name, blocks in (("chained", default), ("per epoch", 0)):
                chain.CHAIN_BLOCKS = blocks
                try:
                    got[name].append(lane_rate(cfg, int(args.tokens)))
                finally:
                    chain.CHAIN_BLOCKS = default
        row = {"lanes": k}
        for name, runs in got.items():
            row[name] = {"tokens_per_s": statistics.median(r[0] for r in runs),
                         "every_run": [r[0] for r in runs], "executions": runs[0][1],
                         "epochs": runs[0][2]}  # fmt: skip
        row["ratio"] = row["chained"]["tokens_per_s"] / row["per epoch"]["tokens_per_s"]
        rows.append(row)
        c, p = row["chained"], row["per epoch"]
        print(f"lane 0 of {k}: chained {c['tokens_per_s'] / 1e6:.2f}M tokens/s "
              f"({c['executions']} executions, {c['epochs']} epochs), per epoch "
              f"{p['tokens_per_s'] / 1e6:.2f}M ({p['executions']} executions): "
              f"x{row['ratio']:.2f}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"points": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
