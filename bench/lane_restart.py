"""What a lane's death costs the ranks: the same served run twice, once whole and once with a
lane's process killed (SIGKILL) partway, on one private local Ray.

    python -m bench lane-restart [--lanes 2] [--world-size 4] [--steps 600] [--kill-at 200]
        [--step-ms 0] [--config PATH]

The ranks are threads of this process, each `Feed.connect(...)` and `next(feed)` as a trainer
calls it, `--step-ms` apart (0: as fast as they can, so the lanes are behind and the producer
meets the death; a step time keeps the window full, and a rank meets it). Once rank 0 has
`--kill-at` steps, lane 1's process is killed; the service starts it again from its state at
the oldest step it holds (`service.lane_restarts`) and the ranks wait for the steps it makes
again. Printed, for each run: wall time from the first step to the last, the ranks' longest
wait for one step (the stall) against their median, and for the killed run the restart (lane,
step it started again from, steps made again) and whether every rank's rows equal the whole
run's, byte for byte. The ratio of the two wall times is the cost of the death on this run;
the stall is what a trainer sees. Default config: the demo corpus's pretraining stream, seq_len
2048, global batch 32 (`bench.serve_ranks`' config).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import statistics
import sys
import threading
import time


def _pull(name: str, rank: int, world: int, steps: int, step_s: float, out: dict,
          progress: list[int]) -> None:  # fmt: skip
    """A rank: `steps` batches, each's arrival time and a digest of its rows."""
    from trainer.feed import Feed

    feed = Feed.connect(service=name, rank=rank, world_size=world, timeout_s=300)
    times, digest = [], hashlib.sha256()
    for _ in range(steps):
        batch = next(feed, None)
        if batch is None:
            break
        times.append(time.monotonic())
        progress[rank] = len(times)
        for column in ("input_ids", "labels", "position_ids"):
            digest.update(batch[column].numpy().tobytes())
        if step_s:
            time.sleep(step_s)
    feed.close()
    out[rank] = {"times": times, "digest": digest.hexdigest()}


def serve_once(cfg, name: str, world: int, steps: int, step_s: float,
               kill: tuple[int, int] | None) -> dict:  # fmt: skip
    """One served run to `steps`; `kill` (rank 0's step, lane): that lane's process killed
    once rank 0 has that many steps."""
    import ray

    from service.serve import _close, start_server

    actor = start_server(cfg, name=name)
    got: dict[int, dict] = {}
    progress = [0] * world
    threads = [threading.Thread(target=_pull, args=(name, r, world, steps, step_s, got, progress))
               for r in range(world)]  # fmt: skip
    try:
        for t in threads:
            t.start()
        killed_at = None
        if kill is not None:
            at, lane = kill
            while progress[0] < at and threads[0].is_alive():
                time.sleep(0.005)
            lanes = ray.get(actor.metrics.remote(), timeout=30)["lanes"]
            os.kill(int(lanes[lane]["pid"]), signal.SIGKILL)
            killed_at = time.time()
        ahead = []  # the chunks the control asked ahead, sampled through the run
        while any(t.is_alive() for t in threads):
            ahead.append(ray.get(actor.metrics.remote(), timeout=30)["lanes_chunks_ahead"])
            time.sleep(0.2)
        for t in threads:
            t.join()
        metrics = ray.get(actor.metrics.remote(), timeout=30)
    finally:
        _close(actor)
    if len(got) != world or any(len(g["times"]) != steps for g in got.values()):
        raise SystemExit(f"the ranks took {[len(g['times']) for g in got.values()]} of {steps}")
    gaps = [
        b - a for g in got.values() for a, b in zip(g["times"][:-1], g["times"][1:], strict=True)
    ]
    first = min(g["times"][0] for g in got.values())
    last = max(g["times"][-1] for g in got.values())
    return {
        "wall_s": last - first,
        "median_gap_ms": 1000 * statistics.median(gaps),
        "stall_s": max(gaps),
        "digests": [got[r]["digest"] for r in range(world)],
        "restarted": metrics.get("lanes_restarted") or [],
        "killed_at": killed_at,
        "global_step": metrics.get("global_step"),
        "chunks_ahead": (min(ahead, default=0), max(ahead, default=0)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench lane-restart", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", default=None, help="a tokenmill config (default: demo corpus)")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--kill-at", type=int, default=200, help="rank 0's step at the kill")
    ap.add_argument("--kill-lane", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.0, help="each rank's time per step")
    args = ap.parse_args(argv)

    import ray

    from bench.serve_ranks import bench_config
    from pipeline.read.resolve import load_config, parse_config
    from service.demo_corpus import build_demo_corpus

    if args.config:
        raw = load_config(args.config).model_dump(mode="json", context={"reveal_secrets": True})
    else:
        raw = bench_config(build_demo_corpus(), 2048, 32)
    cfg = parse_config(raw | {"lanes": args.lanes})
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        step_s = args.step_ms / 1000
        whole = serve_once(cfg, f"whole{os.getpid()}", args.world_size, args.steps, step_s, None)
        killed = serve_once(cfg, f"killed{os.getpid()}", args.world_size, args.steps, step_s,
                            (args.kill_at, args.kill_lane))  # fmt: skip
    finally:
        ray.shutdown()
    same = killed["digests"] == whole["digests"]
    print(f"lanes {args.lanes}, {args.world_size} ranks, {args.steps} steps, "
          f"a rank's step {args.step_ms:g} ms; lane {args.kill_lane} killed at rank 0's "
          f"step {args.kill_at}")  # fmt: skip
    for label, r in (("whole", whole), ("killed", killed)):
        print(f"  {label:7s} wall {r['wall_s']:7.2f} s  median step {r['median_gap_ms']:7.2f} ms"
              f"  longest wait {r['stall_s']:6.2f} s  made {r['global_step']} steps, "
              "chunks asked ahead {}-{}".format(*r["chunks_ahead"]))  # fmt: skip
    for r in killed["restarted"]:
        print(
            f"  restart: lane {r['lane']} from step {r['step']}, {r['steps']} steps made "
            f"again ({r['reason']}), "
            f"{r['at'] - killed['killed_at']:.2f} s after the kill"
        )
    print(f"  killed ÷ whole wall: {killed['wall_s'] / whole['wall_s']:.3f}")
    print(f"  every rank's rows the same as the whole run's: {'yes' if same else 'NO'}")
    if not killed["restarted"]:
        print("  the lane was not started again (killed after the lanes had made every step?)")
        return 1
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
