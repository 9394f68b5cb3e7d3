"""One lane's ceiling: what a single service process serves when it has a core of its own.

    python -m bench service-ceiling [--steps 600] [--repeat 40] [--lanes 1,2,4] [--json PATH]

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

`--lanes K`: the same with `lanes: K`, each lane actor pinned to a core of its own (the last K
cores) and the rest (the control actor, which holds no token, the consumers, Ray) to the cores
before them; K consumers, rank k of K taking its rows straight from lane k. It prints each
lane's rate and CPU busy, the sum of the lanes' rates ÷ busy (the K lanes' ceiling), the
control actor's busy and the rate at which its core would be full, and how it adds up: the
total ÷ (K × the one-lane figure). A lane reads its own share (`read.in_lanes`) where one lane
takes blocks from Ray Data's tasks; `--reads-elsewhere` gives lanes Ray Data's tasks too. Needs K + 1 cores to mean what it says; with fewer, the rest shares
the lanes' cores and the line says so.
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

from bench.cpu import cpu_s

SEQ_LEN, BATCH = 2048, 32


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


def _consume(actor, rank: int, world: int, steps: int, marks: list, lanes: bool) -> None:
    """Rank `rank` of `world` takes `steps` steps as fast as it can, 32 per call, decoding only
    `seq_lens`; `marks` gets (monotonic, steps done, tokens done) after each answer."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    from wire.lane_rows import LaneActors, fetch
    from wire.protocol import POLL_S

    actors = LaneActors(lambda key: ray.get(actor.lane_handles.remote(key)))
    step, tokens = 0, 0
    while step < steps:
        reply = ray.get(actor.get.remote(rank, world, step, POLL_S, 32))
        if reply.status == "end":
            break
        if not reply.ready:
            continue
        runs = fetch(reply.lanes, rank, world, 120.0, actors)[0] if lanes else reply.runs
        for run in runs:
            batch = pa.ipc.open_stream(run).read_next_batch()
            tokens += int(pc.sum(pc.list_flatten(batch["seq_lens"])).as_py())
        step += reply.steps
        marks.append((time.monotonic(), step, tokens))


def measure(source: Path, steps: int, repeat: int, pin: bool, lanes: int = 1,
            in_lanes: bool = True) -> dict:  # fmt: skip
    """One service over `source`, `lanes` lanes, one consumer per lane, `steps` global steps.

    `lanes` 1: the service's actor is the process pinned to the last core. `lanes` K > 1: the
    K lane actors are pinned one to each of the last K cores, and the rest (the control actor,
    the consumers, Ray) to the cores before them; with K cores or fewer there is no core left
    for the rest, and it shares them all (said as `rest_shares_the_lanes_cores`)."""
    import threading

    import ray

    from pipeline.read.resolve import parse_config
    from service.serve import start_server

    cores = sorted(os.sched_getaffinity(0))
    rest_shares = pin and len(cores) <= lanes
    rest = set(cores) if rest_shares else set(cores[:-lanes])
    if pin:
        os.sched_setaffinity(0, rest)  # Ray, started now, inherits it
    cfg = parse_config({
        "seed": 1, "seq_len": SEQ_LEN, "global_batch_size": BATCH, "shuffle": {"window": 64},
        "packing": {"mode": "concat"}, "lanes": lanes, "read": {"in_lanes": in_lanes},
        "streams": {"code": {"paths": [str(source)], "format": "export", "repeat": repeat}},
    })  # fmt: skip
    ray.init(address="local", num_cpus=max(1, len(rest) if pin else len(cores)),
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)  # fmt: skip
    try:
        actor = start_server(cfg, name=f"bench-ceiling-{os.getpid()}", prefetch=64)
        control = ray.get(actor.status.remote())["server"]["pid"]
        if lanes == 1:
            pids = [control]
        else:  # the lanes say where they run once started (metrics `lanes`)
            view = ray.get(actor.metrics.remote())["lanes"]
            while any(d["pid"] is None for d in view):
                time.sleep(0.1)
                view = ray.get(actor.metrics.remote())["lanes"]
            pids = [d["pid"] for d in view]
        if pin:
            for k, pid in enumerate(pids):
                _pin(pid, {cores[len(cores) - lanes + k]})
        for r in range(lanes):
            ray.get(actor.hello.remote(r, lanes))
        marks: list[list] = [[] for _ in range(lanes)]
        cpu: list[tuple[float, list[float]]] = []  # (monotonic, CPU s of each pinned process)
        threads = [threading.Thread(target=_consume, args=(actor, r, lanes, steps, marks[r],
                                                           lanes > 1)) for r in range(lanes)]  # fmt: skip
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            cpu.append((time.monotonic(), [cpu_s(p) for p in pids + [control]]))
            time.sleep(0.2)
        for t in threads:
            t.join()
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()
        os.sched_setaffinity(0, set(cores))
    # Steady: from the moment every rank is half way to the moment the last rank ends.
    done = min(m[-1][1] for m in marks)
    t0 = max(next(x[0] for x in m if x[1] >= done // 2) for m in marks)
    t1 = max(m[-1][0] for m in marks)
    wall = t1 - t0

    def tokens_between(m: list) -> float:
        before = [x for x in m if x[0] <= t0]
        return m[-1][2] - (before[-1][2] if before else 0)

    c0 = next(c for c in cpu if c[0] >= t0)
    c1 = cpu[-1]
    span = c1[0] - c0[0]
    busy = [(b - a) / span for a, b in zip(c0[1], c1[1], strict=True)]
    per_lane = [tokens_between(m) / wall for m in marks]
    return {"pinned": pin, "cores": len(cores), "lanes": lanes, "steps": done,
            "steady_tokens_per_s": sum(per_lane), "per_lane_tokens_per_s": per_lane,
            "lane_busy": busy[:lanes], "control_busy": busy[lanes] if lanes > 1 else None,
            "service_busy": busy[0],
            "projected_ceiling": sum(r / b for r, b in zip(per_lane, busy, strict=False) if b),
            "rest_shares_the_lanes_cores": rest_shares, "window_s": wall}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench service-ceiling", description=__doc__)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=40, help="passes over the pre-tokenized input")
    ap.add_argument("--lanes", default="1", help="comma-separated lane counts (each divides 32)")
    ap.add_argument("--reads-elsewhere", action="store_true", help="lanes take their blocks "
                    "from Ray Data's tasks (read.in_lanes: false), as one lane does, instead of "
                    "reading their share themselves")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    counts = [int(k) for k in args.lanes.split(",")]
    if len(os.sched_getaffinity(0)) < 2:
        print("needs 2 cores or more: one for the service, the others for the rest")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    try:
        source = pretokenized(work)
        rows = [measure(source, args.steps, args.repeat, pin, k, not args.reads_elsewhere)
                for k in counts for pin in (True, False)]  # fmt: skip
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    base = {r["pinned"]: r["steady_tokens_per_s"] for r in rows if r["lanes"] == 1}
    head = (f"{'lanes':>5}  {'placement':<34}{'served tok/s':>14}{'x K x 1 lane':>14}"
            f"{'per lane tok/s':>22}{'lane CPU busy':>18}{'÷ busy':>14}{'control busy':>14}"
            f"{'÷ busy':>14}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        k = r["lanes"]
        if not r["pinned"]:
            what = f"unpinned ({r['cores']} cores)"
        elif r["rest_shares_the_lanes_cores"]:
            what = "a core each, the rest shares them"
        else:
            what = "a core each, the rest elsewhere"
        adds = r["steady_tokens_per_s"] / (k * base[r["pinned"]]) if r["pinned"] in base else None
        per = "/".join(f"{x / 1e6:.1f}M" for x in r["per_lane_tokens_per_s"])
        busy = "/".join(f"{b:.2f}" for b in r["lane_busy"])
        c = r["control_busy"]
        control = "-" if c is None else f"{c:.2f}"
        r["control_ceiling"] = r["steady_tokens_per_s"] / c if c else None
        cc = r["control_ceiling"]
        print(f"{k:>5}  {what:<34}{r['steady_tokens_per_s']:>14,.0f}"
              f"{'-' if adds is None else f'{adds:.2f}':>14}{per:>22}{busy:>18}"
              f"{r['projected_ceiling']:>14,.0f}{control:>14}"
              f"{'-' if cc is None else f'{cc:,.0f}':>14}")  # fmt: skip
        r["adds_up"] = adds
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
