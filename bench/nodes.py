"""Scaling out: what the control process costs, against K lanes and N data nodes.

    python -m bench nodes [--nodes 2] [--lanes 1,2,4] [--steps 240] [--world-size 4]
        [--cpus-per-node 1] [--json PATH]

One Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head with no CPUs that holds
the control, and N data nodes, each its own raylet and object store, that hold the lanes),
then one service per K, each serving the same config to W ranks (threads of this process, one
driver) that take `--steps` steps as fast as they can. Per K it prints:
- control CPU ms a step: the batch server's process (user + system, /proc), over the run;
- control row bytes a step: token rows that passed through the control process to the ranks
  (metrics `control_row_bytes`). With K > 1 the ranks take their rows from the lanes and this
  is 0; with `lanes: 1` the control makes and sends every row;
- served tokens/s: real tokens the ranks got (sum of `seq_lens`) in the second half of the
  steps, over its time (production and delivery, end to end; start-up and the prefetch
  window, drained in the first half, left out);
- ranks' wait: the share of the ranks' time, after their first step, spent in `next(feed)`,
  in a second service of the same K whose ranks spend `--step-ms` on each step (a trainer's
  step), beginning as soon as they have connected: start-up included, as a user sees it.

On a machine with fewer cores than nodes x cpus-per-node the nodes share the cores, and the
figures show what bounds scaling (the control's CPU and bytes), not the scaling itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.cpu import cpu_s

MB = 1 << 20


def _ranks(name: str, world: int, steps: int, address: str, step_s: float) -> list[dict]:
    """W ranks as threads; each records when each step arrived and its time in `next`, and
    spends `step_s` on each step (a trainer's step), or none."""
    from trainer.feed import Feed

    got: list[dict] = [{} for _ in range(world)]

    def rank(r: int) -> None:
        feed = Feed.connect(service=name, rank=r, world_size=world, address=address,
                            timeout_s=300)  # fmt: skip
        arrived, tokens, waited = [], [], 0.0
        for i in range(steps):
            t = time.monotonic()
            batch = next(feed)
            if i:  # after its first step: start-up is not a wait
                waited += time.monotonic() - t
            arrived.append(time.monotonic())
            tokens.append(sum(sum(x) for x in batch["seq_lens"]))
            if step_s:
                time.sleep(step_s)
        feed.close()
        got[r] = {"arrived": arrived, "tokens": tokens, "waited": waited}

    on_threads(rank, world)
    return got


def on_threads(fn: Callable[[int], None], n: int) -> None:
    """`fn(0)` .. `fn(n - 1)`, each on a thread of its own (ranks of one driver); the first
    error any of them raised is raised here, once all have ended."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001  # raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def measure(cfg_raw: dict, lanes: int, world: int, steps: int, address: str,
            step_s: float = 0.0) -> dict:  # fmt: skip
    import ray

    from pipeline.read.resolve import parse_config
    from service.serve import _close, start_server

    cfg = parse_config(cfg_raw | {"lanes": lanes})
    name = f"nodes{lanes}-{int(step_s * 1000)}"
    actor = start_server(cfg, name=name)
    try:
        pid = ray.get(actor.status.remote(), timeout=60)["server"]["pid"]
        cpu0 = cpu_s(pid)
        got = _ranks(name, world, steps, address, step_s)
        cpu = cpu_s(pid) - cpu0
        m = ray.get(actor.metrics.remote(), timeout=60)
    finally:
        _close(actor)
    first = steps // 2
    done = [max(g["arrived"][s] for g in got) for s in range(steps)]  # a step's last rank
    tokens = sum(sum(g["tokens"][first + 1 :]) for g in got)
    span = done[-1] - done[first]
    run = [g["arrived"][-1] - g["arrived"][0] for g in got]
    nodes = sorted({lane.get("node_id") for lane in m.get("lanes") or [] if lane.get("node_id")})
    return {
        "lanes": lanes,
        "lane_nodes": len(nodes) or None,  # lanes: 1 runs in the control process
        "control_cpu_ms_per_step": 1000 * cpu / steps,
        "control_row_bytes_per_step": m["control_row_bytes"] / steps,
        "served_tokens_per_s": tokens / span if span > 0 else None,
        "ranks_wait_share": sum(g["waited"] for g in got) / max(1e-9, sum(run)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench nodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="data nodes")
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--lanes", default="1,2,4", help="K values, comma-separated")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=50.0, help="the paced ranks' step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="tn", dir="/tmp"))
    for var in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS"):
        os.environ.pop(var, None)
    import ray
    from ray.cluster_utils import Cluster

    from bench.serve_ranks import bench_config
    from client.cluster import connect
    from service.demo_corpus import build_demo_corpus

    raw = bench_config(build_demo_corpus(), args.seq_len, args.global_batch_size)
    raw["service"] = {"resources": {"data": 1}, "control_resources": {"control": 0.01}}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": {"control": 1}, "object_store_memory": 200 * MB})  # fmt: skip
    rows = []
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus_per_node, resources={"data": 8},
                             object_store_memory=200 * MB)  # fmt: skip
        cluster.wait_for_nodes()
        connect(cluster.address)
        print(f"{'lanes':>5} {'nodes':>5} {'ctl ms/step':>11} {'ctl row B/step':>14} "
              f"{'served tok/s':>12} {'wait at ' + f'{args.step_ms:g}' + ' ms':>14}")  # fmt: skip
        for k in (int(x) for x in args.lanes.split(",")):
            row = measure(raw, k, args.world_size, args.steps, cluster.address)
            paced = measure(raw, k, args.world_size, args.steps, cluster.address,
                            args.step_ms / 1000)  # fmt: skip
            row["ranks_wait_share"] = paced["ranks_wait_share"]
            rows.append(row)
            rate = row["served_tokens_per_s"]
            print(f"{k:>5} {row['lane_nodes'] or '-':>5} {row['control_cpu_ms_per_step']:>11.2f} "
                  f"{row['control_row_bytes_per_step']:>14,.0f} "
                  f"{'-' if rate is None else f'{rate:,.0f}':>12} "
                  f"{100 * row['ranks_wait_share']:>13.1f}%", flush=True)  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
