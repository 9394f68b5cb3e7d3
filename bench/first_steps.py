"""The ranks' wait at a trainer's step, in their first steps and after, against Ray Data's
`streaming_split` on the same corpus in the same run.

    python -m bench first-steps [--corpus site-packages:128] [--world-size 4] [--steps 300]
        [--step-ms 50] [--repeats 2] [--lanes 1] [--methods tokenmill,ray-data,baseline]
        [--config JSON] [--baseline JSON] [--json PATH]

W ranks (threads of this process, one driver, one local Ray for both) each take `--steps`
batches and spend `--step-ms` on each one (a trainer's step), beginning as soon as they have
connected. A rank's wait is its time in `next()` after its first batch (the first batch is
time to first batch, reported apart). Per method it prints the ranks' total wait as a share of
their run, the wait in their first 32 steps and in the steps after (as a share of those
steps' time), the longest single wait, and the first batch's time from the method's start.

- tokenmill: `start_server` (L = 2048, G = 32, the default tokenizer with its check, `lanes`
  as given) and `Feed.connect` per rank;
- Ray Data: `read_json` -> `map_batches` tokenizing with the same tokenizer file on an actor
  pool of the machine's CPUs (bench.peers's `_RayTokenize`) -> `map_batches` packing each
  batch's documents end to end into rows of L -> `streaming_split(W, equal=True)`; each rank
  iterates its split with `iter_batches(batch_size=G / W)`. No shuffle, mixing, resume or
  exactness check: a user's plain pipeline;
- baseline: tokenmill with `--baseline`'s config keys instead of `--config`'s (by default
  `read.ramp_parts: 1`: every piece read whole), to compare a setting within one run.

Methods alternate, tokenmill first, `--repeats` times. Each method starts on a settled cluster:
the last one's CPUs free again and its actors no longer dying (`_settle`), so that neither pays
for the other's teardown. The figures are shares of the same runs' time, not rates: compare them within
one run of the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.nodes import on_threads

SEQ_LEN, BATCH, FIRST = 2048, 32, 32


def _ranks(world: int, steps: int, step_s: float, make: Callable[[int], Iterator]) -> dict:
    """W threads; `make(rank)` gives that rank's batch iterator (connecting is its start)."""
    waits: list[list[float]] = [[] for _ in range(world)]
    firsts = [0.0] * world
    start = time.monotonic()

    def rank(r: int) -> None:
        it = make(r)
        for i in range(steps):
            t = time.monotonic()
            next(it)
            if i == 0:
                firsts[r] = time.monotonic() - start
            else:
                waits[r].append(time.monotonic() - t)
            time.sleep(step_s)

    on_threads(rank, world)
    first, rest = FIRST - 1, steps - FIRST  # waits are of steps 2..steps

    def share(ws: list[float], n: int) -> float:
        return sum(ws) / (sum(ws) + n * step_s)

    return {
        "wait": statistics.mean(share(w, steps - 1) for w in waits),
        "wait_first": statistics.mean(share(w[:first], first) for w in waits),
        "wait_after": statistics.mean(share(w[first:], rest) for w in waits),
        "longest_s": max(max(w) for w in waits),
        "longest_at": max(range(steps - 1), key=lambda i: max(w[i] for w in waits)) + 2,
        "first_batch_s": max(firsts),
    }


def tokenmill(corpus: Path, world: int, steps: int, step_s: float, lanes: int,
              extra: dict) -> dict:  # fmt: skip
    from pipeline.read.resolve import parse_config
    from service.serve import _close, start_server
    from trainer.feed import Feed

    cfg = parse_config({"seed": 1234, "seq_len": SEQ_LEN, "global_batch_size": BATCH,
                        "lanes": lanes, "streams": {"code": {"paths": [str(corpus)]}},
                        **extra})  # fmt: skip
    name = f"first-steps-{time.monotonic_ns()}"
    actor = start_server(cfg, name=name)
    feeds: list = []

    def make(r: int) -> Iterator:
        feed = Feed.connect(service=name, rank=r, world_size=world, timeout_s=300)
        feeds.append(feed)
        return feed

    try:
        return _ranks(world, steps, step_s, make)
    finally:
        for f in feeds:
            f.close()
        _close(actor)


def ray_data(corpus: Path, world: int, steps: int, step_s: float) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    from bench.peers import _RayTokenize, _tokenizer_file
    from client.cluster import usable_cpus

    def pack(batch: pa.Table) -> pa.Table:
        flat = pc.list_flatten(batch.column("input_ids")).to_numpy()
        k = len(flat) // SEQ_LEN
        rows = np.ascontiguousarray(flat[: k * SEQ_LEN].reshape(k, SEQ_LEN))
        return pa.table({"input_ids": list(rows)})

    ds = ray.data.read_json(str(corpus), lines=True, num_cpus=0).select_columns(["text"])
    ds = ds.map_batches(_RayTokenize, fn_constructor_args=(_tokenizer_file(),), batch_size=64,
                        batch_format="pyarrow", concurrency=usable_cpus(), num_cpus=1)  # fmt: skip
    ds = ds.map_batches(pack, batch_format="pyarrow", num_cpus=0)
    splits = ds.streaming_split(world, equal=True)

    def make(r: int) -> Iterator:
        return iter(splits[r].iter_batches(batch_size=BATCH // world, batch_format="pyarrow"))

    return _ranks(world, steps, step_s, make)


def _settle(timeout_s: float = 120.0, quiet_s: float = 3.0) -> float:
    """Wait until the last method's CPUs are free and its actors have stopped dying (Ray kills
    a dropped pipeline's actors asynchronously: a run that began meanwhile shared the cores
    with their teardown). The actors alive must stay the same for `quiet_s`: some stay for
    the driver's life (Ray Data's stats and split coordinators). Returns the seconds waited."""
    import ray
    from ray._private.state import actors  # the GCS's table: no dashboard here (connect)

    t0 = time.monotonic()
    last: tuple[frozenset, float] = (frozenset(), t0)
    while (now := time.monotonic()) - t0 < timeout_s:
        free = ray.available_resources().get("CPU", 0.0)
        alive = frozenset(k for k, a in actors().items() if a.get("State") != "DEAD")
        if alive != last[0]:
            last = (alive, now)
        elif free >= ray.cluster_resources().get("CPU", 0.0) and now - last[1] >= quiet_s:
            break
        time.sleep(0.5)
    else:
        print(f"(not settled after {timeout_s:.0f} s: {free:g} CPU free; going on)", flush=True)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench first-steps", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--corpus", default="site-packages:128", help="a JSONL file, or "
                    "site-packages[:MB] (bench/corpora.py), or 'demo'")  # fmt: skip
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--methods", default="tokenmill,ray-data")
    ap.add_argument("--config", default="{}", help="tokenmill's config keys on top, as JSON "
                    "(e.g. '{\"shuffle\": {\"pieces\": 0}}')")  # fmt: skip
    ap.add_argument("--baseline", default="{\"read\": {\"ramp_parts\": 1}}",
                    help="the config keys of method 'baseline' (tokenmill with these instead of "
                    "--config; by default whole pieces, as before read.ramp_parts), e.g. "
                    "--methods tokenmill,baseline")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # Ray's own temp folder, made here unless RAY_TMPDIR names one, and removed at the end
    made = None if "RAY_TMPDIR" in os.environ else tempfile.mkdtemp(prefix="tf", dir="/tmp")
    if made:
        os.environ["RAY_TMPDIR"] = made
    for var in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS"):
        os.environ.pop(var, None)
    from client.cluster import connect, shutdown

    started = connect(None)
    try:
        return _measure(args)
    finally:
        shutdown(started)
        if made:
            # Ray's last processes may still write there for a moment after the shutdown (a
            # run with Ray Data left the folder once): try again for a few seconds.
            for _ in range(10):
                shutil.rmtree(made, ignore_errors=True)
                if not os.path.exists(made):
                    break
                time.sleep(0.5)


def _measure(args: argparse.Namespace) -> int:
    """Each method, `args.repeats` times, alternating on the settled cluster: the table."""
    from bench.corpora import resolve_corpus

    corpus = resolve_corpus(None if args.corpus == "demo" else args.corpus)
    step_s = args.step_ms / 1000
    rows = []
    print(f"{args.world_size} ranks, {args.steps} steps at {args.step_ms:g} ms, {corpus.name}")
    print(f"{'method':<10} {'wait':>6} {'first 32':>9} {'after':>6} {'longest':>8} {'at step':>8}"
          f" {'1st batch':>10}")  # fmt: skip
    for i in range(args.repeats):
        for method in args.methods.split(","):
            settled = _settle()
            if method in ("tokenmill", "baseline"):
                keys = args.config if method == "tokenmill" else args.baseline
                r = tokenmill(corpus, args.world_size, args.steps, step_s, args.lanes,
                              json.loads(keys))  # fmt: skip
            else:
                r = ray_data(corpus, args.world_size, args.steps, step_s)
            rows.append({"method": method, "run": i, "settle_s": settled, **r})
            print(f"{method:<10} {r['wait']:>6.1%} {r['wait_first']:>9.1%} {r['wait_after']:>6.1%}"
                  f" {r['longest_s']:>7.2f}s {r['longest_at']:>8} {r['first_batch_s']:>9.2f}s",
                  flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
