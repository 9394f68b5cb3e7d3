"""Resume cost: time from a saved state to the first batch, early and late in a run.

    python -m bench resume [--steps N] [--json PATH]

On a warm cluster (one feed has already run to its first step, so Ray's workers are up and
hold the tokenizer), times the first batch of a fresh feed over the demo mixture, runs it
straight for N steps keeping the states after step 2 and after step N - 1, then builds a fresh
feed from each state and times its first step.
Because a resume seeks (cursor + one shuffle window + the packing buffer) instead of
re-reading the prefix, the late resume should cost about what the early one does; the
ratio late/early is the figure, the absolute seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def warm_latencies(cfg, steps: int) -> dict:
    """On the current (warm) Ray: first batch of a fresh feed, and of feeds resumed early/late.

    Each figure is the wall time from constructing the feed to holding its first step.
    """
    from pipeline.feed import StepFeed

    t = time.perf_counter()
    feed = StepFeed(cfg)
    feed.next_step()
    first_s = time.perf_counter() - t
    states = {}
    t = time.perf_counter()
    for step in range(1, steps):
        if step in (2, steps - 1):
            states[step] = feed.get_state()
        if feed.next_step() is None:
            break
    straight_s = time.perf_counter() - t
    feed.close()
    result = {"steps": steps, "first_batch_s": first_s, "straight_run_s": straight_s}
    result["resume_s"] = {}
    for step, state in states.items():
        t = time.perf_counter()
        resumed = StepFeed(cfg, state=state)
        resumed.next_step()
        result["resume_s"][step] = time.perf_counter() - t
        resumed.close()
    early, late = (result["resume_s"][s] for s in sorted(result["resume_s"]))
    result["late_over_early"] = late / early
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench resume", description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    from client.cluster import connect
    from pipeline.read.resolve import parse_config
    from service.demo import demo_config
    from service.demo_corpus import build_demo_corpus

    connect()
    cfg = parse_config(demo_config(build_demo_corpus()))
    warm_up(cfg)
    result = warm_latencies(cfg, args.steps)
    ray.shutdown()
    print(f"first batch, warm cluster: {result['first_batch_s']:.2f}s")
    print(f"straight run of {args.steps} steps: {result['straight_run_s']:.1f}s")
    for step, s in result["resume_s"].items():
        print(f"resume at step {step:>5}: first batch after {s:.2f}s")
    print(f"late / early: {result['late_over_early']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def warm_up(cfg) -> None:
    """Make the cluster warm: one feed to its first step (workers started, tokenizer cached)."""
    from pipeline.feed import StepFeed
    from pipeline.lanes import LanedFeed

    feed = StepFeed(cfg) if cfg.lanes == 1 else LanedFeed(cfg)
    feed.next_step()
    feed.close()


if __name__ == "__main__":
    raise SystemExit(main())
