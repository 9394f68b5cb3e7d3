"""Memory while streaming a corpus several times the object-store cap (the bar: flat).

    python -m bench memory [--cap-mb 128] [--times 5] [--json PATH]

Starts a local Ray whose object store is capped at `--cap-mb`, then exports a corpus of
`--times` x that many bytes of text (the demo code corpus read for as many epochs as needed),
sampling once a second:
  - object-store bytes in use (the raylet's store stats),
  - the private memory (RSS minus shared pages, so the mapped object store is not counted
    again per process) of the driver and of every Ray worker process, summed.
"Flat" is judged by comparing the median of the second quarter of the run with the median of
the last quarter: a leak or an unbounded queue shows as growth between them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _private_rss(proc) -> int:
    m = proc.memory_info()
    return max(m.rss - getattr(m, "shared", 0), 0)


def _ray_processes():
    import psutil

    me = psutil.Process()
    procs = [me]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::"):
            procs.append(p)
    return procs


def private_rss_total() -> int:
    """Private RSS of this process and every Ray worker process on this machine, summed."""
    total = 0
    for p in _ray_processes():
        with contextlib.suppress(Exception):  # a worker that just exited
            total += _private_rss(p)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__)
    ap.add_argument("--cap-mb", type=int, default=128)
    ap.add_argument("--times", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    from pipeline.read.resolve import parse_config
    from service.demo_corpus import build_demo_corpus
    from service.export import run_export

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local throwaway cluster
    cap = args.cap_mb << 20
    code = build_demo_corpus() / "code.jsonl"
    epochs = max(1, round(args.times * cap / code.stat().st_size + 0.5))
    ray.init(address="local", num_cpus=2, object_store_memory=cap, include_dashboard=False)
    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    samples: list[dict] = []
    stop = threading.Event()

    def sample():
        t0 = time.monotonic()
        while not stop.is_set():
            used = get_memory_info_reply(state).store_stats.object_store_bytes_used
            rss = private_rss_total()
            samples.append({"t": time.monotonic() - t0, "store": used, "rss": rss})
            stop.wait(1.0)

    cfg = parse_config(
        {
            "seq_len": 2048,
            "global_batch_size": 16,
            "packing": {"mode": "bfd"},
            "streams": {"code": {"paths": [str(code)], "repeat": epochs}},
        }
    )
    out = Path(tempfile.mkdtemp(prefix="tokenmill-memory-"))
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        summary = run_export(cfg, out, fmt="arrow")
    finally:
        stop.set()
        thread.join()
        shutil.rmtree(out, ignore_errors=True)
        ray.shutdown()
    n = len(samples)
    q2 = samples[n // 4 : n // 2] or samples
    q4 = samples[3 * n // 4 :] or samples

    def med(part, key):
        return statistics.median(s[key] for s in part)

    result = {
        "object_store_cap_bytes": cap,
        "corpus_bytes": code.stat().st_size * epochs,
        "corpus_over_cap": code.stat().st_size * epochs / cap,
        "tokens": summary.real_tokens,
        "elapsed_s": summary.export.elapsed_s,
        "samples": samples,
        "store_peak": max(s["store"] for s in samples),
        "rss_peak": max(s["rss"] for s in samples),
        "store_q2_median": med(q2, "store"),
        "store_q4_median": med(q4, "store"),
        "rss_q2_median": med(q2, "rss"),
        "rss_q4_median": med(q4, "rss"),
    }
    result["rss_growth"] = result["rss_q4_median"] / result["rss_q2_median"]
    result["store_peak_over_cap"] = result["store_peak"] / cap
    mb = 1 << 20
    print(
        f"corpus {result['corpus_bytes'] / mb:,.0f} MB = {result['corpus_over_cap']:.1f}x the "
        f"{args.cap_mb} MB object store; {result['tokens']:,} tokens in {result['elapsed_s']:.0f}s"
    )
    print(
        f"object store: peak {result['store_peak'] / mb:.0f} MB "
        f"({result['store_peak_over_cap']:.0%} of cap); median 2nd quarter "
        f"{result['store_q2_median'] / mb:.0f} MB, last quarter {result['store_q4_median'] / mb:.0f} MB"
    )
    print(
        f"private RSS (driver + Ray workers): peak {result['rss_peak'] / mb:.0f} MB; median 2nd "
        f"quarter {result['rss_q2_median'] / mb:.0f} MB, last quarter "
        f"{result['rss_q4_median'] / mb:.0f} MB (x{result['rss_growth']:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
