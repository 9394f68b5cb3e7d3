"""One lane's ceiling: what a single service process serves when it has a core of its own.

    python -m bench.lane_ceiling [--steps 600] [--repeat 40] [--json PATH]

The service (one lane: the batch-server actor reads, mixes, packs and serves every token) is
the plane's single process (issue 29). This bench gives that process one core and everything
else the others, so that what it serves is its own ceiling, not the machine's:

1. the input is pre-tokenized (an export of the demo corpus's code.jsonl, read back with
   `format: export`, `repeat` times), so no tokenizer competes: the workers only read
   Parquet, and the service reads their blocks, shuffles, mixes, packs and slices;
2. this process (the consumer, and through it the local Ray it starts: raylet, Ray Data's
   workers) is pinned to cores 0..N-2; once the actor answers, every thread of its process is
   moved to the last core;
3. one consumer takes whole steps as fast as it can, 32 per call, and decodes only their
   `seq_lens` (no torch, no copies): the cheapest rank there is, so that the consumer side
   runs out of work before the service does.

Figures over the second half of the steps (steady: the first half includes the start-up and
the prefetch window filling): tokens/s served, the service process's CPU busy fraction on its
core (utime + stime over wall), and the projection served ÷ busy: the rate at which its core
would be full. A busy fraction near 1 means the figure is the ceiling itself; well under 1
means the rest of the machine (the readers, the consumer) held it back, and the projection
is the estimate. Then the same unpinned (every process on every core), for contrast.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SEQ_LEN, BATCH = 2048, 32


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(pid: int, cores: set[int]) -> int:
    """Every thread of process `pid` onto `cores`; the threads moved."""
    moved = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            moved += 1
        except (ProcessLookupError, PermissionError):
            pass
    return moved


def pretokenized(work: Path) -> Path:
    """The demo corpus's code.jsonl exported once (Parquet step files) to read back."""
    from service.demo_corpus import build_demo_corpus

    corpus = build_demo_corpus() / "code.jsonl"
    cfg = {"seq_len": SEQ_LEN, "global_batch_size": BATCH, "packing": {"mode": "concat"},
           "streams": {"code": {"paths": [str(corpus)]}}}  # fmt: skip
    (work / "text.yaml").write_text(yaml.safe_dump(cfg))
    out = work / "pretokenized"
    subprocess.run([sys.executable, "-m", "service", "export", "--config",
                    str(work / "text.yaml"), "--out", str(out)], check=True,
                   capture_output=True)  # fmt: skip
    return out


def measure(source: Path, steps: int, repeat: int, pin: bool) -> dict:
    """One service over `source`, one consumer, `steps` global steps."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    from pipeline.read.resolve import parse_config
    from service.serve import start_server
    from wire.protocol import POLL_S

    cores = sorted(os.sched_getaffinity(0))
    if pin:
        os.sched_setaffinity(0, set(cores[:-1]))  # Ray, started now, inherits it
    cfg = parse_config({
        "seed": 1, "seq_len": SEQ_LEN, "global_batch_size": BATCH, "shuffle": {"window": 64},
        "packing": {"mode": "concat"},
        "streams": {"code": {"paths": [str(source)], "format": "export", "repeat": repeat}},
    })  # fmt: skip
    ray.init(address="local", num_cpus=max(1, len(cores) - (1 if pin else 0)),
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)  # fmt: skip
    try:
        actor = start_server(cfg, name=f"bench-ceiling-{os.getpid()}", prefetch=64)
        pid = ray.get(actor.status.remote())["server"]["pid"]
        if pin:
            _pin(pid, {cores[-1]})
        ray.get(actor.hello.remote(0, 1))
        marks = []  # (monotonic, steps done, tokens done, actor cpu s)
        step, tokens = 0, 0
        while step < steps:
            reply = ray.get(actor.get.remote(0, 1, step, POLL_S, 32))
            if reply.status == "end":
                break
            if not reply.ready:
                continue
            for run, n in zip(reply.runs, reply.counts, strict=True):
                batch = pa.ipc.open_stream(run).read_next_batch()
                tokens += int(pc.sum(pc.list_flatten(batch["seq_lens"])).as_py())
                step += n
            marks.append((time.monotonic(), step, tokens, _cpu_s(pid)))
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()
        os.sched_setaffinity(0, set(cores))
    half = next(m for m in marks if m[1] >= step // 2)
    last = marks[-1]
    wall = last[0] - half[0]
    rate = (last[2] - half[2]) / wall
    busy = (last[3] - half[3]) / wall
    return {"pinned": pin, "cores": len(cores), "steps": step, "steady_tokens_per_s": rate,
            "service_busy": busy, "projected_ceiling": rate / busy if busy else None,
            "window_s": wall}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=40, help="passes over the pre-tokenized input")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("needs 2 cores or more: one for the service, the others for the rest")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    try:
        source = pretokenized(work)
        rows = [measure(source, args.steps, args.repeat, pin) for pin in (True, False)]
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"{'service':<26}{'steady tok/s':>14}{'service CPU busy':>18}{'÷ busy':>14}")
    for r in rows:
        what = "pinned to a core of its own" if r["pinned"] else f"unpinned ({r['cores']} cores)"
        ceiling = r["projected_ceiling"]
        print(f"{what:<26}{r['steady_tokens_per_s']:>14,.0f}{r['service_busy']:>18.2f}"
              f"{'-' if ceiling is None else f'{ceiling:,.0f}':>14}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
