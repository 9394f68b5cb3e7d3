"""Do the chunks asked ahead absorb the lanes' bursts? Each lane's time per step, replayed.

    python -m bench.lane_window [--lanes 16] [--steps 4000] [--corpus FILE.jsonl|site-packages]
        [--read-ahead]

A lane reads and tokenizes a read unit at a time, so its cost per step comes in bursts: the
step that needs the next unit pays for all of it (at 16 lanes and 8 MiB units, ~0.2 s of a
core every ~450 steps, ~0.5 ms the others). The control asks every lane for the same chunk of
steps (`steps_per_call`), a number of chunks ahead of the one it joins (`LanedFeed.depth`),
and asks the next only once it has joined one, which needs every lane's part: so a lane in a
burst stops the others once they have made what was asked of them. With a core per lane, a
burst costs nothing if the chunks asked ahead outlast it.

This bench makes each lane's steps alone, one step a call, in this process (as
`bench.lane_rates` does: `LaneWorker`, holding, a state every step, the rank's take; with
`--read-ahead`, reading on a thread of its own, `read.ahead`), and records the time of each
step. Then it replays the K lanes' times together, each lane on a core of its own, as the
control asks them: chunk c goes to every lane once every lane has made chunk c - depth - 1;
the ranks take each joined step at once. It prints the replay's steps per second, and ÷ the
slowest lane's own rate (1.00: the chunks asked ahead cost nothing), for the depths the
control uses: `in_flight` while the lanes keep ahead, up to `most_in_flight` while it waits on
them (pipeline/lanes/depth.py). A model, not a served run: it leaves out the control's and the
ranks' CPU and Ray's calls. A step made alone in a call carries that call's cost, which comes
with every step alike.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

WINDOWS = (8, 16, 32, 64, 128, 256)


def step_times(cfg, steps: int, ahead: bool) -> np.ndarray:
    """[lane, step]: each lane's seconds per step, made alone, one step a call; reading its
    share ahead on a thread of its own (`ahead`, as a lane actor does) or as it packs."""
    from pipeline.lanes import LaneWorker

    lanes = cfg.lanes
    times = np.zeros((lanes, steps))
    for k in range(lanes):
        lane = LaneWorker(cfg.model_dump(mode="json", context={"reveal_secrets": True}), k,
                          None, False, False, True, False, hold=True, read_ahead=ahead)  # fmt: skip
        lane.steps(8, 0)  # warm: the tokenizer loaded, the first read begun
        n = 8
        for s in range(steps):
            t = time.perf_counter()
            made, _ = lane.steps(1, 1, n)
            lane.take([(made.first, 0, int(made.rows[0]))], k, lanes)
            times[k, s] = time.perf_counter() - t
            n += 1
        lane.close()
        print(f"  lane {k:>2}: median {np.median(times[k]) * 1e3:.2f} ms a step, p99 "
              f"{np.percentile(times[k], 99) * 1e3:.1f} ms, max {times[k].max() * 1e3:.1f} ms",
              flush=True)  # fmt: skip
    return times


def replay(times: np.ndarray, per_call: int, depth: int) -> float:
    """Steps per second of the K lanes as the control asks them: in chunks of `per_call`
    steps, `depth` chunks ahead of the one it joins. Chunk c goes to every lane once every lane
    has made chunk c - depth - 1 (the control asks it after joining that one), and a lane makes
    its chunks in order; the ranks take each joined step at once (saturated: the window of
    handed-out steps is never full)."""
    lanes, steps = times.shape
    chunks = steps // per_call
    cost = times[:, : chunks * per_call].reshape(lanes, chunks, per_call).sum(axis=2)
    done = np.zeros(lanes)
    joined = np.zeros(chunks)
    for c in range(chunks):
        gate = joined[c - depth - 1] if c > depth else 0.0
        done = np.maximum(done, gate) + cost[:, c]
        joined[c] = done.max()
    return chunks * per_call / joined[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4000, help="steps per lane")
    ap.add_argument("--corpus", default=None, help="a JSONL text file, or site-packages[:MB] "
                    "(bench/corpora.py; default: the demo's code)")  # fmt: skip
    ap.add_argument("--read-ahead", action="store_true",
                    help="each lane reads on a thread of its own (read.ahead) (default: False)")  # fmt: skip
    args = ap.parse_args(argv)
    from bench.corpora import resolve_corpus
    from bench.lane_rates import BATCH, bench_config

    if BATCH % args.lanes:
        raise SystemExit(f"--lanes must divide {BATCH}")
    from pipeline.lanes import in_flight, most_in_flight, steps_per_call

    cfg = bench_config(str(resolve_corpus(args.corpus)), args.lanes)
    times = step_times(cfg, args.steps, args.read_ahead)
    own = args.steps / times.sum(axis=1)
    per_call, least, most = steps_per_call(args.lanes), in_flight(args.lanes), most_in_flight(cfg)
    print(f"{args.lanes} lanes alone: {own.min():.0f} to {own.max():.0f} steps/s. Replayed as "
          f"the control asks them ({per_call} steps a call), steps/s and ÷ the slowest lane's "
          "own rate:")  # fmt: skip
    depths = sorted({least, 2 * least, 4 * least, most})
    for depth in depths:
        r = replay(times, per_call, depth)
        mark = {least: "   (in_flight: the least, while the lanes keep ahead)",
                most: "   (most_in_flight: the most, while the control waits on the lanes)"}  # fmt: skip
        print(f"  {depth:>2} chunks ahead ({depth * per_call:>4} steps): {r:>6.0f} steps/s, "
              f"{r / own.min():.3f}{mark.get(depth, '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
