"""Resume cost: time from a saved state to the first batch, early and late in a run.

    python -m bench.resume [--steps N] [--json PATH]

Runs the demo mixture straight for N steps on Ray, keeping the states after step 2 and after
step N, then builds a fresh feed from each state (same warm cluster) and times its first step.
Because a resume seeks (cursor + one shuffle window + the packing buffer) instead of
re-reading the prefix, the late resume should cost about what the early one does; the
ratio late/early is the figure, the absolute seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    from pipeline.config import parse_config
    from pipeline.feed import Feed
    from service.cluster import connect
    from service.demo import demo_config
    from service.demo_corpus import build_demo_corpus

    connect()
    cfg = parse_config(demo_config(build_demo_corpus()))
    feed = Feed(cfg)
    states = {}
    t = time.perf_counter()
    for step in range(args.steps):
        if step in (2, args.steps - 1):
            states[step] = feed.state()
        if feed.next_step() is None:
            break
    straight_s = time.perf_counter() - t
    result = {"steps": args.steps, "straight_run_s": straight_s, "resume_s": {}}
    for step, state in states.items():
        t = time.perf_counter()
        resumed = Feed(cfg, state=state)
        resumed.next_step()
        result["resume_s"][step] = time.perf_counter() - t
    ray.shutdown()
    early, late = (result["resume_s"][s] for s in sorted(result["resume_s"]))
    result["late_over_early"] = late / early
    print(f"straight run of {args.steps} steps: {straight_s:.1f}s")
    for step, s in result["resume_s"].items():
        print(f"resume at step {step:>5}: first batch after {s:.2f}s")
    print(f"late / early: {result['late_over_early']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
