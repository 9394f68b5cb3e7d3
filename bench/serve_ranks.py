"""Serving: what the batch service delivers to 8 simulated trainer ranks, against the export.

    python -m bench serving [--quick] [--json PATH] [--config PATH] [--threads]
        [--world-size 8] [--no-export]

The bar, "serving": 8 ranks that consume without a model receive >= 0.85 x the export's
steady rate; p99 `next(feed)` reported. One run, on one private local Ray (object store
capped at 512 MiB), over one config (default: the demo corpus's pretraining stream, seq_len
2048, global batch 32, i.e. 4 rows of 2048 per rank and step):

1. warm-up: one feed to its first step (Ray's workers up, the tokenizer loaded);
2. export: `service.export.run_export` in this process for N steps (world size 1, Parquet,
   as `tokenmill export` runs it);
3. serve: the batch-server actor (`service.serve.start_server`) and 8 ranks, each calling
   `next(feed)` on `trainer.feed.Feed.connect(..., rank=r, world_size=8)` as fast as it can
   for the same N steps (the same global sequence the export wrote);
4. export again, the same N steps: the export's rates are the mean of 2 and 4, so that the
   serving sits between its two measures (this VM's speed drifts 20-30% within a minute:
   with one export before, two runs of one commit gave ratios of 1.17 and 0.77).

Rates, each defined the same way for both: real tokens (sum of seq_lens) of the steps after
step k over the time from step k done to the last step done. The export reports progress
every few steps, so k is the last step of one of its reports. A served step is done when its
last rank holds it, and a rank holds a step when the answer that carried it arrived: one
answer carries up to 32 steps, so the steps of one answer arrive together, and k is moved on
to the last step that arrived with it (counting the steps that came in k's answer as arrived
after k would credit them with no time).
- headline, "steady": k about N/2. The reads are 8 MiB blocks (~35 steps of 32 x 2048
  here), tokenized ahead while the first step waits, so the steps right after the first are
  packed from memory and the start-up is still in flight; by mid-run both pipelines run at
  their sustained pace. Ratio = served / export, the bar >= 0.85; the GPUs-fed figures use
  the served steady rate.
- "after step 3" (the export's first report): the export's own "first step to last". On a
  short run it mostly measures packing blocks already tokenized (a quick run once gave the
  export "9M tokens/s" over the 36 steps after step 3, done in 0.26 s).
- "from the feed's start": all N steps over the time from the feed's construction (the
  export's call; the actor's `__init__`, from its `uptime_s`, so starting the actor's
  process is not counted) to the last step: start-up included.
The service's k is later if it had produced step k before all ranks said hello (reported as
`produced_before_all_connected`; the ranks ask for the actor before it exists, since
`Feed.connect` waits for it, so normally 0). `--quick` runs 40 steps: a smoke test, whose
"steady" half is 20 steps, within one or two read blocks, so not a steady figure.
Also: p50/p99/max `next(feed)` latency (steps after each rank's first), step 0's, and how
many GPUs consuming 10k / 50k tokens/s each that keeps fed. A sampler records CPU seconds
per global step of the export's driver (this process), the server actor and the ranks, and
the machine's busy fraction (other users included), over the steady windows: on few cores
they say where the time goes.

Ranks are processes by default, one Python process (one Ray driver) per rank, as torchrun
starts them on a trainer node: each rank pays its own actor calls, object fetches and
Arrow -> torch copy, with no GIL shared between ranks. On a 2-core machine these 8
processes share the cores with the producer's tokenization; a trainer node's data path does
too (with more cores). They are started first (importing Ray and torch while this process
starts Ray), join the cluster before either measurement, and sit idle (blocked on a pipe)
during the export, so both measurements run with the same processes alive. `--threads` runs
the 8 ranks as threads of this process instead (one Ray driver, one GIL: less CPU on few
cores, less like a real node). The absolute figures are this machine's; the ratio is the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.cpu import Sampler, lane_pids
from bench.ranks import WORLD, RankProcesses, RankThreads

GOAL = 0.85
GPU_RATES = (10_000, 50_000)
OBJECT_STORE_BYTES = 512 << 20


def bench_config(corpus: Path, seq_len: int, global_batch: int) -> dict:
    """A pretraining stream over the demo corpus's module sources, read as often as needed."""
    return {
        "seed": 1234,
        "seq_len": seq_len,
        "global_batch_size": global_batch,
        "shuffle": {"window": 64},
        "streams": {"code": {"paths": [str(corpus / "code.jsonl")], "repeat": 1000}},
    }


# -- figures ------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _mid_report(reports: list[tuple[float, int, int]], steps: int) -> tuple[float, int, int]:
    """The progress report that opens an export's steady window: the one nearest step N/2."""
    return min(reports[:-1], key=lambda r: abs(r[1] - steps // 2))


def _export_rates(reports: list[tuple[float, int, int]], t_start: float, steps: int) -> dict:
    """An export's rates, {label: (tokens/s, after step)}, from its progress reports (time,
    steps written, real tokens): "steady" after the report nearest step N/2, "first_step"
    after the first report, "from_start" from the export's call."""
    t_end, tok_end = reports[-1][0], reports[-1][2]
    mid = _mid_report(reports, steps)
    out = {
        label: ((tok_end - tok_a) / (t_end - t_a), written - 1)
        for label, (t_a, written, tok_a) in {"steady": mid, "first_step": reports[0]}.items()
    }
    out["from_start"] = (tok_end / (t_end - t_start), steps - 1)
    return out


def delivered(results: list[dict], steps: int) -> dict:
    """What the ranks got, by global step: when it was done (its last rank holds it), its real
    tokens over all ranks, the ranks' CPU seconds by then (processes), and the latencies."""
    by_step: dict[int, list] = {}
    for res in results:
        for step, _, _, tokens, cpu, arrived in res["steps"]:
            by_step.setdefault(step, []).append((arrived, tokens, cpu))
    complete = sorted(s for s, v in by_step.items() if len(v) == len(results))
    if complete != list(range(steps)):
        raise RuntimeError(f"the ranks got {len(complete)} complete steps of {steps}")
    lat = [x[2] for res in results for x in res["steps"] if x[0] > 0]
    first_lat = [x[2] for res in results for x in res["steps"] if x[0] == 0]
    return {
        "done": [max(x[0] for x in by_step[s]) for s in complete],
        "tokens": [sum(x[1] for x in by_step[s]) for s in complete],
        "cpu": [sum(x[2] for x in by_step[s]) for s in complete],
        "calls_per_rank": sum(res.get("calls", 0) for res in results) / len(results),
        "latency_ms": {
            "n": len(lat),
            "p50": 1e3 * _percentile(lat, 50),
            "p90": 1e3 * _percentile(lat, 90),
            "p99": 1e3 * _percentile(lat, 99),
            "max": 1e3 * max(lat),
            "mean": 1e3 * sum(lat) / len(lat),
            "step0_max": 1e3 * max(first_lat),
        },
    }


def _lanes_busy(metrics: dict, serve_s: float) -> dict | None:
    """Each lane's making time as a share of the serve (feed start to last step done), wall
    and CPU, and the producer's wait on the lanes: a step waits for its slowest lane, the
    one near 1. None with one lane (the server's own feed)."""
    lanes = metrics.get("lanes")
    if not lanes or any(d.get("making_s") is None for d in lanes):
        return None
    busy = [d["making_s"] / serve_s for d in lanes]
    cpu = [d["making_cpu_s"] / serve_s for d in lanes]
    top = max(range(len(busy)), key=busy.__getitem__)
    return {"busy": busy, "cpu": cpu, "busiest": top,
            "producer_waited": (metrics.get("lanes_waited_s") or 0.0) / serve_s,
            "chunks_ahead": metrics.get("lanes_chunks_ahead")}  # fmt: skip


def _table(r: dict) -> str:
    rates, lat, cpu = r["tokens_per_s"], r["latency_ms"], r["cpu_steady"]
    world = r["world_size"]
    ok = "" if r["ratio"] is None else "meets" if r["ratio"] >= GOAL else "BELOW"
    gpus = "   ".join(f"at {k // 1000}k tok/s each: {v:,.1f}" for k, v in r["gpus_fed"].items())
    labels = {
        "steady": f"steady, after step {rates['steady']['after_step']}",
        "first_step": f"after step {rates['first_step']['after_step']} (first report)",
        "from_start": "from the feed's start",
    }
    actor = cpu["served"]["actor_ms_per_step"]
    e = cpu["export"]
    exp = None if e is None else (e["driver_ms_per_step"], e["machine_busy"])
    rows = [
        f"serving {world} ranks ({r['ranks_as']}), seq_len {r['seq_len']}, global batch "
        f"{r['global_batch_size']} ({r['global_batch_size'] // world} rows/rank), "
        f"{r['steps']} steps, prefetch window {r['prefetch']}, {r['cpus']} CPUs",
        f"  {'tokens/s to the last step':<34}{'export':>12}{f'served, {world} ranks':>18}{'ratio':>8}"
        "   (export: the mean of one before and one after serving)",
    ]
    for key, label in labels.items():
        x = rates[key]
        if x["export"] is None:  # --no-export
            rows.append(f"  {label:<34}{'-':>12}{x['served']:>18,.0f}{'-':>8}")
            continue
        rows.append(f"  {label:<34}{x['export']:>12,.0f}{x['served']:>18,.0f}{x['ratio']:>8.3f}"
                    + f"   ({' / '.join(f'{e:,.0f}' for e in x['exports'])})"
                    + (f"   {ok} the goal >= {GOAL}" if key == "steady" else ""))  # fmt: skip
    rows += [
        f"  {'next(feed) latency':<34}p50 {lat['p50']:.1f} ms   p99 {lat['p99']:.1f} ms   "
        f"max {lat['max']:.0f} ms   (step 0: {lat['step0_max']:.0f} ms)   "
        f"{r['steps_per_call']:.2f} steps per call",
        f"  {'GPUs kept fed (steady)':<34}{gpus}",
        *(
            []
            if (ln := r.get("lanes")) is None
            else [
                f"  {'lanes making (share of the serve)':<34}busiest lane {ln['busiest']}: "
                f"{ln['busy'][ln['busiest']]:.0%} wall, {ln['cpu'][ln['busiest']]:.0%} CPU; "
                f"least {min(ln['busy']):.0%}; the producer waited on them "
                f"{ln['producer_waited']:.0%}, asking {ln.get('chunks_ahead')} chunks ahead "
                "at the end"
            ]
        ),
        f"  {'CPU ms per step (steady)':<34}export driver "
        f"{'-' if exp is None else f'{exp[0]:.1f}'}"
        f" | server actor {'?' if actor is None else f'{actor:.1f}'}"
        + (
            ""
            if (lanes_ms := cpu["served"].get("lanes_ms_per_step")) is None
            else f" + lanes {lanes_ms:.1f} (busiest "
            f"{cpu['served']['busiest_lane_cores']:.0%} of a core)"
        )
        + f" + ranks {cpu['served']['ranks_ms_per_step']:.1f}"
        f"   (machine busy {'-' if exp is None else f'{100 * exp[1]:.0f}%'} | "
        f"{100 * cpu['served']['machine_busy']:.0f}%)",
    ]
    return "\n".join(rows)


# -- the run ------------------------------------------------------------------------------


def main(argv=None) -> int:
    t_start = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="python -m bench serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="a smoke test (40 steps)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--config", default=None, help="a tokenmill config (default: demo corpus)")
    ap.add_argument("--steps", type=int, default=None, help="global steps (default 40 / 1000)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="the service's prefetch window (default: the service's own)",
    )
    ap.add_argument("--threads", action="store_true", help="ranks as threads of this process")
    ap.add_argument("--world-size", type=int, default=WORLD, help=f"ranks (default {WORLD})")
    ap.add_argument("--no-export", dest="export", action="store_false", help="serve only: no "
                    "export before and after (no ratio; the steady window opens at step N/2)")  # fmt: skip
    args = ap.parse_args(argv)
    steps = args.steps or (40 if args.quick else 1000)
    if steps < 12:
        ap.error("--steps must be at least 12")

    work = Path(tempfile.mkdtemp(prefix="tokenmill-serve-ranks-"))
    name = f"tokenmill-bench-{os.getpid()}"
    # Rank processes import Ray and torch while this process starts Ray.
    world = args.world_size
    ranks = (RankThreads(name, steps, world) if args.threads
             else RankProcesses(name, steps, work, world))  # fmt: skip
    from client.cluster import connect, shutdown

    print(f"[serve_ranks {time.monotonic() - t_start:5.1f}s] imports done; starting Ray",
          file=sys.stderr, flush=True)  # fmt: skip
    started = connect(None, object_store_memory=OBJECT_STORE_BYTES)
    try:  # the figures are printed and written before Ray goes down
        return _run(args, steps, work, name, ranks, t_start)
    finally:
        ranks.close()  # before Ray goes
        shutdown(started)
        shutil.rmtree(work, ignore_errors=True)


def _run(args, steps: int, work: Path, name: str, ranks, t_start: float) -> int:
    import ray

    from bench.resume import warm_up
    from pipeline.read.resolve import load_config, parse_config
    from service.demo_corpus import build_demo_corpus
    from service.export import run_export
    from service.serve import _close, start_server

    if args.config:
        cfg = load_config(args.config)
    else:
        cfg = parse_config(bench_config(build_demo_corpus(), args.seq_len, args.global_batch_size))
    world = args.world_size
    if cfg.global_batch_size % world:
        raise SystemExit(f"global_batch_size {cfg.global_batch_size} is not divisible by {world}")

    def log(what: str) -> None:
        print(f"[serve_ranks {time.monotonic() - t_start:5.1f}s] {what}", file=sys.stderr,
              flush=True)  # fmt: skip

    actor = None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        ranks.join(ray.get_runtime_context().gcs_address)
        log("Ray up; warm-up")
        warm_up(cfg)
        ranks.wait_ready()
        reports: list[tuple[float, int, int]] = []  # (time, steps written, real tokens)
        again: list[tuple[float, int, int]] = []
        t_export = t_again = 0.0
        exported = None
        with Sampler() as sampler:
            if args.export:
                log("export")
                t_export = time.monotonic()
                exported = run_export(cfg, work / "export", steps=steps,
                                      progress=lambda n, tok, _: reports.append((time.monotonic(), n, tok)))  # fmt: skip
                shutil.rmtree(work / "export", ignore_errors=True)

            log("serve")
            ranks.go()  # the ranks wait for the actor: connected before its first step
            t_go = time.monotonic()
            actor = start_server(cfg, name=name, prefetch=args.prefetch)
            t_up = time.monotonic()
            st = ray.get(actor.status.remote(), timeout=30)
            t_init = time.monotonic() - st["uptime_s"]  # its __init__ began: the feed's start
            sampler.actor_pid, t_pid = st["server"]["pid"], time.monotonic()
            while st["ranks_connected"] < world and time.monotonic() - t_up < 120:
                time.sleep(0.01)
                st = ray.get(actor.status.remote(), timeout=30)
            produced_at_connect = st["global_step"]
            sampler.lane_pids = lane_pids(actor)
            results = ranks.results(timeout_s=600)
            metrics = ray.get(actor.metrics.remote(), timeout=30)
        _close(actor)
        actor = None
        if args.export:
            log("export again")  # serving between two exports: drift over the run is halved
            t_again = time.monotonic()
            run_export(cfg, work / "export", steps=steps,
                       progress=lambda n, tok, _: again.append((time.monotonic(), n, tok)))  # fmt: skip
            shutil.rmtree(work / "export", ignore_errors=True)
        log("done")
    finally:
        if actor is not None:
            _close(actor)
        ranks.close()
        log("ranks gone")

    for r in (reports, again) if args.export else ():
        if r[-1][1] != steps:
            raise RuntimeError(f"an export wrote {r[-1][1]} steps of {steps}")
    got = delivered(results, steps)
    done, tokens = got["done"], got["tokens"]
    cum = [sum(tokens[: s + 1]) for s in range(steps)]
    # Windows open after export step `after` (the last step of one of its progress reports);
    # with no export, after step N/2 and after step 0.
    if args.export:
        exports = [_export_rates(reports, t_export, steps), _export_rates(again, t_again, steps)]
        after = {label: exports[0][label][1] for label in ("steady", "first_step")}
    else:
        exports, after = [], {"steady": steps // 2 - 1, "first_step": 0}
    rates: dict[str, dict] = {}
    for label in ("steady", "first_step"):
        a = after[label]
        s_a = max(a, produced_at_connect)  # the ranks were all there when it was produced
        while s_a + 1 < steps and done[s_a + 1] == done[s_a]:  # came in one answer with s_a
            s_a += 1
        rates[label] = {
            "after_step": a,
            "export": sum(e[label][0] for e in exports) / 2 if exports else None,
            "exports": [e[label][0] for e in exports],
            "served": (cum[-1] - cum[s_a]) / (done[-1] - done[s_a]),
            "served_after_step": s_a,
        }
    rates["from_start"] = {
        "export": sum(e["from_start"][0] for e in exports) / 2 if exports else None,
        "exports": [e["from_start"][0] for e in exports],
        "served": cum[-1] / (done[-1] - t_init),
    }
    for r in rates.values():
        r["ratio"] = r["served"] / r["export"] if r["export"] else None
    rate = rates["steady"]["served"]
    # CPU over the steady windows, per global step.
    a, s_a = rates["steady"]["after_step"], rates["steady"]["served_after_step"]
    n_export, n_served = steps - 1 - a, steps - 1 - s_a
    cpu_export = (sampler.window(_mid_report(reports, steps)[0], reports[-1][0])
                  if args.export else None)  # fmt: skip
    cpu_served = sampler.window(max(done[s_a], t_pid), done[-1])
    ranks_cpu = cpu_served["this_process_cpu_s"] if args.threads else got["cpu"][-1] - got["cpu"][s_a]  # fmt: skip
    actor_cpu = cpu_served["actor_cpu_s"]
    lanes_cpu = cpu_served["lanes_cpu_s"]
    result = {
        "ranks_as": "threads" if args.threads else "processes",
        "world_size": world,
        "cpus": cpus,
        "seq_len": cfg.seq_len,
        "global_batch_size": cfg.global_batch_size,
        "steps": steps,
        "prefetch": metrics["prefetch"],
        "object_store_bytes": OBJECT_STORE_BYTES,
        "config": args.config or "demo corpus, code stream (pretrain)",
        "tokens": reports[-1][2] if reports else cum[-1],
        "tokens_served": cum[-1],
        "tokens_per_s": rates,
        "ratio": rates["steady"]["ratio"],
        "goal": GOAL,
        "gpus_fed": {g: rate / g for g in GPU_RATES},
        "latency_ms": got["latency_ms"],
        "steps_per_call": steps / max(1.0, got["calls_per_rank"]),
        "export_summary": None
        if exported is None
        else {  # its own figures (service/export.py)
            "tokens_per_s": exported.export.tokens_per_s,
            "steady_tokens_per_s": exported.export.steady_tokens_per_s,
            "time_to_first_step_s": exported.export.time_to_first_step_s,
        },
        # From the feed's start to step `first_step.after_step` done (the export's first report).
        "time_to_first_report_s": {
            "export": reports[0][0] - t_export if reports else None,
            "served": done[reports[0][1] - 1 if reports else 0] - t_init,
        },
        "server_start_s": t_up - t_go,  # the actor's process up, before its feed starts
        "produced_before_all_connected": produced_at_connect,
        "packing_efficiency": metrics["packing_efficiency"],
        "lanes": _lanes_busy(metrics, done[-1] - t_init),
        "cpu_steady": {
            "export": None
            if cpu_export is None
            else {
                "machine_busy": cpu_export["machine_busy"],
                "driver_ms_per_step": 1e3 * cpu_export["this_process_cpu_s"] / n_export,
            },
            "served": {
                "machine_busy": cpu_served["machine_busy"],
                "actor_ms_per_step": None if actor_cpu is None else 1e3 * actor_cpu / n_served,
                "ranks_ms_per_step": 1e3 * ranks_cpu / n_served,
                # The lane processes' CPU (all their threads: reading, tokenizing, packing,
                # serving the ranks), and the busiest one's share of a core: a lane near 1
                # is out of core, and every step waits for its slowest lane.
                "lanes_ms_per_step": None if lanes_cpu is None else 1e3 * sum(lanes_cpu) / n_served,
                "busiest_lane_cores": None
                if lanes_cpu is None
                else max(lanes_cpu) / max(1e-9, cpu_served["seconds"]),
            },
        },
        "wall_s": time.monotonic() - t_start,
    }
    print(_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
