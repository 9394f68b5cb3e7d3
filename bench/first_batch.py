"""Time to first batch: from launching `tokenmill serve` against a running cluster to every
rank's first batch.

    python -m bench first-batch [--ranks 4] [--runs 3] [--config PATH] [--json PATH]

One private Ray head (`ray start --head`, its own temp dir and ports, stopped by its process
group; never `ray stop`) stands for the user's running cluster. Each run launches
`python -m service serve --address <head>` and `--ranks` rank processes; each rank imports
torch (as a trainer does), calls `Feed.connect(service=..., address=<head>)` (which waits for
the service to come up) and `next(feed)`, and prints the wall clock when its first batch is
in its hands. The figure per run is the latest rank's time after `serve` was launched, in two
ways:

- ranks waiting: the ranks are up, joined to Ray and in `Feed.connect`, waiting for the
  service, when `serve` is launched (a trainer whose model is loaded, waiting for data):
  the service's own start, the figure the 3 s bar is about;
- launched together: the ranks start at the same instant as `serve`, their interpreters and
  torch imports in the figure (and on 2 cores, in the way of the service's start).

The baseline, measured in the same run on the same cluster: a warm `tokenmill export
--steps 1` (the same config), from launch to its first step written.

Default config: the demo corpus (`tokenmill corpus --out data/demo`, built if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
# A rank as a trainer is one: torch imported before it asks for data. With "wait", it joins
# Ray first (as Feed.connect does, its serializer built), says "ready", and is then in
# Feed.connect, waiting for the service, when `serve` is launched.
RANK = r"""
import sys, time
import torch
t0 = time.time()
from client.cluster import connect
from trainer.feed import Feed
if sys.argv[5] == "wait":
    import ray
    connect(sys.argv[4])
    ray.put(None)
    print("ready", flush=True)
feed = Feed.connect(service=sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]),
                    address=sys.argv[4], timeout_s=300)
next(feed)
print(f"{t0} {time.time()}", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(temp: str) -> tuple[subprocess.Popen, str]:
    gcs = free_port()
    ports = [f"--{k}={free_port()}" for k in ("ray-client-server-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "dashboard-port")]  # fmt: skip
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", "--include-dashboard=false",
         f"--temp-dir={temp}", "--object-store-memory=500000000", *ports],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", gcs), timeout=2):
                time.sleep(2.0)  # the raylet registers after the GCS listens
                return proc, f"127.0.0.1:{gcs}"
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("ray start --head did not come up")


def serve_run(config: Path, gcs: str, ranks: int, run: int, workdir: Path,
              ranks_first: bool) -> dict:  # fmt: skip
    """One launch of `serve`. `ranks_first`: the ranks are up and joined to Ray (a trainer
    whose model is loaded), waiting for the service, when `serve` is launched; otherwise they
    are launched at the same instant as `serve`, their interpreters and torch imports in the
    figure (and on these 2 cores, in the way of the service's start)."""
    name, port = f"fb{os.getpid()}x{run}", free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                name,
                str(r),
                str(ranks),
                gcs,
                "wait" if ranks_first else "go",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(ranks)
    ]
    if ranks_first:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise RuntimeError("a rank did not get ready")
    with open(workdir / f"serve-{run}.log", "w") as log:
        t0 = time.time()
        serve = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--config", str(config), "--address", gcs,
             "--port", str(port), "--name", name], stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    firsts, imports = [], []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed: {err[-2000:]}")
            started, first = map(float, out.split()[-2:])
            firsts.append(first - t0)
            imports.append(started - t0)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
    return {"every_rank_s": max(firsts), "first_rank_s": min(firsts),
            "rank_torch_imported_s": max(imports)}  # fmt: skip


def export_run(config: Path, gcs: str, workdir: Path) -> float:
    out = workdir / f"export-{time.time_ns()}"
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "service", "export", "--config", str(config), "--address", gcs,
         "--steps", "1", "--out", str(out)], check=True, capture_output=True,
    )  # fmt: skip
    return time.time() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench first-batch")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    config = args.config
    if config is None:
        if not Path("data/demo/code.jsonl").exists():
            subprocess.run([sys.executable, "-m", "service", "corpus", "--out", "data/demo"],
                           check=True, capture_output=True)  # fmt: skip
        config = Path("examples/demo.yaml")
    config = config.resolve()
    temp = tempfile.mkdtemp(prefix="tmfb", dir="/tmp")
    head, gcs = start_head(temp)
    workdir = Path(tempfile.mkdtemp(prefix="tmfb-out"))
    try:
        export_run(config, gcs, workdir)  # warm-up: the cluster's workers, the caches
        serves: dict[str, list[dict]] = {"ranks_waiting": [], "launched_together": []}
        exports = []
        for run in range(args.runs):
            exports.append(export_run(config, gcs, workdir))
            for mode, first in (("ranks_waiting", True), ("launched_together", False)):
                serves[mode].append(serve_run(config, gcs, args.ranks, run, workdir, first))
            w, t = serves["ranks_waiting"][-1], serves["launched_together"][-1]
            print(f"run {run}: export first step {exports[-1]:.2f} s; serve, every rank's "
                  f"first batch: ranks waiting {w['every_rank_s']:.2f} s, launched together "
                  f"{t['every_rank_s']:.2f} s (their torch imported by "
                  f"{t['rank_torch_imported_s']:.2f} s)", flush=True)  # fmt: skip
        export = statistics.median(exports)
        medians = {
            m: statistics.median(s["every_rank_s"] for s in runs) for m, runs in serves.items()
        }
        result = {"ranks": args.ranks, "runs": args.runs, "config": str(config),
                  "serve_every_rank_first_batch_s": medians["ranks_waiting"],
                  "serve_launched_together_s": medians["launched_together"],
                  "export_first_step_s": export,
                  "ratio_serve_to_export": medians["ranks_waiting"] / export,
                  "runs_detail": serves, "exports": exports}  # fmt: skip
        print(
            f"median: every rank's first batch {medians['ranks_waiting']:.2f} s after `serve` "
            f"was launched to ranks waiting for it, {medians['launched_together']:.2f} s with "
            f"the ranks launched at the same instant; a warm export's first step {export:.2f} s"
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
