"""Lanes against cores: the export's rate with the whole process tree confined to N cores.

    python -m bench lanes [--cores 1,2] [--repeats 2] [--epochs 24] [--world-size 8] [--json PATH]
    python -m bench lanes --served [--cores 1,2] [--steps 1000] [--steps-per-core S]
        [--served-repeats 3] [--served-world 8|lanes] [--no-export] [--json PATH]
    (either: [--inputs text,pre-tokenized] [--corpus FILE.jsonl | site-packages[:MB]])

Each point is a fresh `tokenmill export` process started under `taskset -c 0..N-1`, so the
export, its embedded Ray (which sizes itself to the cores it may use: client/cluster.py
`usable_cpus`), Ray Data's workers and the lane actors all share N cores. At each N it runs
`lanes: 1` and `lanes: N` over the same corpus, on two inputs:

- text: the demo corpus's code.jsonl (`epochs` passes), tokenized by the workers;
- pre-tokenized: an export of that corpus read back as a source (`format: export`), so only
  reading, mixing, packing and writing remain: where one feed's single process shows.

Figures, from each export's summary.json: `steady` (tokens/s over the second half of the
run's steps, the export's own definition) and end to end (process start to last file). The
ratios: steady ÷ (N × the 1-core, 1-lane steady of the same input), and the text export's
steady ÷ (N × fastokens' single-core rate on the same texts, measured here in this process).
Medians of `repeats` runs. The absolute figures are this machine's; the ratios are the point.
Each export writes files for `--world-size` ranks (default 8, a node of 8 GPUs): with lanes,
each lane writes the files of the ranks whose rows it holds, so a world that K divides keeps
the writing in the lanes (a world of 1 makes the export's process join every step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.corpora import corpus_texts

SEQ_LEN, BATCH = 2048, 32


def fastokens_rate(texts: list[str], repeats: int = 3) -> float:
    """Tokens/s of the fast engine on one core (this process, one thread)."""
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    tok = load_tokenizer(TokenizerConfig())
    assert tok.fast is not None, "no fast engine for the default tokenizer"
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        n = sum(len(x) for x in tok.fast.encode(texts))
        best = max(best, n / (time.perf_counter() - t))
    return best


def export(config: dict, work: Path, cores: int, tag: str, world: int = 1) -> dict:
    """One confined export process; its summary's figures."""
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / tag
    cpus = f"0-{cores - 1}" if cores > 1 else "0"
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "service", "export",
           "--config", str(path), "--out", str(out), "--world-size", str(world)]  # fmt: skip
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    for f in out.iterdir():  # keep the disk free; the summary has what we need
        if f.name != "summary.json":
            f.unlink()
    return {"steady": s["steady_tokens_per_s"], "end_to_end": s["tokens_per_s"],
            "tokens": s["real_tokens"], "steps": s["steps"], "wall_s": wall}  # fmt: skip


def served(config: dict, work: Path, cores: int, tag: str, steps: int, world: int = 8,
           with_export: bool = True) -> dict:  # fmt: skip
    """One confined `bench.serve_ranks` (the service, its lanes and `world` model-less rank
    processes under `taskset` on N cores): its figures. `with_export` False: served only (no
    export before and after: no ratio, half the time)."""
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / f"{tag}.json"
    cpus = f"0-{cores - 1}" if cores > 1 else "0"
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "bench.serve_ranks", "--config", str(path),
           "--steps", str(steps), "--json", str(out), "--world-size", str(world)]  # fmt: skip
    if not with_export:
        cmd.append("--no-export")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    d = json.loads(out.read_text())
    steady, cpu = d["tokens_per_s"]["steady"], d["cpu_steady"]["served"]
    ln = d.get("lanes")
    return {"served": steady["served"], "export": steady["export"], "ratio": steady["ratio"],
            "world": world, "lanes_busy": ln,
            "served_from_start": d["tokens_per_s"]["from_start"]["served"],
            "actor_ms_per_step": cpu["actor_ms_per_step"],
            "ranks_ms_per_step": cpu["ranks_ms_per_step"], "machine_busy": cpu["machine_busy"],
            "lanes_ms_per_step": cpu.get("lanes_ms_per_step"),
            "busiest_lane_cores": cpu.get("busiest_lane_cores")}  # fmt: skip


def _busiest(r: dict) -> str:
    """The lanes' processes' CPU per step and the busiest one's share of a core (steady), and
    the busiest lane's making time, wall and its making thread's CPU, as a share of the serve
    (serve_ranks)."""
    ln, out = r["lanes_busy"], ""
    if r.get("lanes_ms_per_step") is not None:
        out = (f", lanes {r['lanes_ms_per_step']:.1f} ms/step (busiest process "
               f"{r['busiest_lane_cores']:.0%} of a core)")  # fmt: skip
    if ln is None:
        return out
    k = ln["busiest"]
    return (f"{out}, busiest lane {k} {ln['busy'][k]:.0%} wall {ln['cpu'][k]:.0%} CPU, producer "
            f"waited {ln['producer_waited']:.0%}, {ln.get('chunks_ahead')} chunks ahead")  # fmt: skip


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def run_served(inputs: dict, cores: list[int], work: Path, steps: int, out: str | None,
               repeats: int = 1, steps_per_core: int = 0, world: str = "8",
               with_export: bool = True, fixed_lanes: int = 0) -> int:  # fmt: skip
    """Served tokens/s against cores: at N cores, `lanes` N (the documented rule: a lane per
    core, K dividing G), and the ratio to N x the 1-core, 1-lane served rate; a projection of
    the data cores that feed 1,024 GPUs at 50k tokens/s each, at the per-core rate of the
    largest N measured (a model: linear past it, which only a larger machine can check).
    `steps_per_core`: serve max(steps, that x N) steps at N cores, so that the steady half
    lasts about as long at every N (a fixed count is over in ~2 s at 16 cores). `fixed_lanes`:
    that many lanes at every N instead of the rule (to tell the lanes from the cores). `world`: the
    ranks, a number or "lanes" (max(8, K): a world K divides, so each rank takes its rows from
    one lane; with 16 lanes and 8 ranks each rank joins two lanes' rows, at twice the CPU)."""
    rows = []
    for kind, cfg in inputs.items():
        for n in cores:
            lanes = fixed_lanes or max(k for k in range(1, n + 1) if BATCH % k == 0)
            n_steps = max(steps, steps_per_core * n)
            w = max(8, lanes) if world == "lanes" else int(world)
            runs = []
            for i in range(repeats):
                runs.append(served(cfg | {"lanes": lanes}, work, n, f"served-{kind}-{n}-{i}",
                                   n_steps, w, with_export))  # fmt: skip
                r = runs[-1]  # each run as it ends: a long bench cut short keeps its points
                exp = "-" if r["export"] is None else f"{r['export'] / 1e6:.2f}M"
                print(f"  {kind}, {n} cores, {lanes} lanes, {w} ranks, {n_steps} steps: served "
                      f"{r['served'] / 1e6:.2f}M tokens/s, export {exp}, "
                      f"actor {r['actor_ms_per_step']:.1f} ms/step, ranks "
                      f"{r['ranks_ms_per_step']:.1f} ms/step{_busiest(r)}",
                      flush=True)  # fmt: skip
            # The run of the median served rate, whole (its figures belong together).
            mid = sorted(runs, key=lambda r: r["served"])[len(runs) // 2]
            rows.append({"input": kind, "cores": n, "lanes": lanes, "steps": n_steps, **mid,
                         "runs_served": [r["served"] for r in runs]})  # fmt: skip
    base = {r["input"]: r["served"] for r in rows if r["cores"] == 1}
    head = (f"{'input':<14}{'cores':>6}{'lanes':>6}{'ranks':>6}{'served tok/s':>14}{'÷ N×1-core':>12}"
            f"{'from start':>12}{'÷ export':>10}{'actor ms/step':>15}{'lanes ms/step':>15}"
            f"{'ranks ms/step':>15}{'busy':>6}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        r["scaling"] = r["served"] / (r["cores"] * base[r["input"]]) if r["input"] in base else None
        scaling = "" if r["scaling"] is None else f"{r['scaling']:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['input']:<14}{r['cores']:>6}{r['lanes']:>6}{r['world']:>6}{r['served']:>14,.0f}"
              f"{scaling:>12}{r['served_from_start']:>12,.0f}{ratio:>10}"
              f"{r['actor_ms_per_step']:>15.1f}{_ms(r.get('lanes_ms_per_step')):>15}"
              f"{r['ranks_ms_per_step']:>15.1f}{r['machine_busy']:>6.0%}")  # fmt: skip
    if repeats > 1:
        for r in rows:
            each = ", ".join(f"{x / 1e6:.2f}M" for x in r["runs_served"])
            print(f"{r['input']} at {r['cores']} cores, every run: {each}")
    need = 1024 * 50_000
    for kind in inputs:
        top = max((r for r in rows if r["input"] == kind), key=lambda r: r["cores"])
        per_core = top["served"] / top["cores"]
        print(f"{kind}: {per_core / 1e6:.2f}M tokens/s per data core at {top['cores']} cores -> "
              f"~{-(-need // per_core):.0f} data cores feed 1,024 GPUs at 50k tokens/s each "
              "(if it stays linear)")  # fmt: skip
    if out:
        Path(out).write_text(json.dumps({"points": rows}, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lanes", description=__doc__)
    ap.add_argument("--cores", default=None, help="comma-separated (default: 1, 2, 4, … up "
                    "to this process's cores)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=2)
    # 24 passes: ~1,000 steps, a steady half of 10 s or more at these rates (4 passes gave
    # ~170 steps, a steady half of ~2 s just after the lanes' start).
    ap.add_argument("--epochs", type=int, default=24, help="passes over code.jsonl")
    ap.add_argument("--world-size", type=int, default=8, help="ranks each export writes for")
    ap.add_argument(
        "--served",
        action="store_true",
        help="served to 8 model-less ranks (bench.serve_ranks) instead of exports",
    )
    ap.add_argument("--steps", type=int, default=1000, help="global steps served (--served)")
    ap.add_argument("--steps-per-core", type=int, default=0, help="(--served) at N cores serve "
                    "max(--steps, this x N) steps")  # fmt: skip
    ap.add_argument("--served-repeats", type=int, default=1, help="runs per point (--served): "
                    "the run of the median served rate is reported, every run's rate beside it")  # fmt: skip
    ap.add_argument("--served-world", default="8", help="(--served) ranks: a number, or "
                    "'lanes' for max(8, lanes)")  # fmt: skip
    ap.add_argument("--lanes", type=int, default=0, help="(--served) this many lanes at every N "
                    "(default: a lane per core)")  # fmt: skip
    ap.add_argument(
        "--no-export",
        dest="with_export",
        action="store_false",
        help="(--served) serve only, no export beside it: no ratio, half the time",
    )
    ap.add_argument("--inputs", default="text,pre-tokenized",
                    help="comma-separated: text, pre-tokenized (default both)")  # fmt: skip
    ap.add_argument("--corpus", default=None, help="the text input, a JSONL file, or "
                    "site-packages[:MB] (bench/corpora.py: the size lanes are for; default: the "
                    "demo corpus's code.jsonl, built from this Python's stdlib)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kinds = args.inputs.split(",")
    if unknown := set(kinds) - {"text", "pre-tokenized"}:
        raise SystemExit(f"--inputs: unknown {sorted(unknown)}; choose text, pre-tokenized")
    from bench.corpora import resolve_corpus
    from client.cluster import usable_cpus

    have = usable_cpus()
    cores = ([int(c) for c in args.cores.split(",")] if args.cores else
             [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= have])  # fmt: skip
    # The demo corpus is the running Python's stdlib: pass the same file to compare machines.
    # With many lanes, `site-packages`: 16 lanes of the demo corpus hold ~36 documents each,
    # and the slowest share bounds them (bench/corpora.py).
    corpus = resolve_corpus(args.corpus)
    work = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
    base = {"seq_len": SEQ_LEN, "global_batch_size": BATCH, "packing": {"mode": "concat"}}
    text = base | {"streams": {"code": {"paths": [str(corpus)], "repeat": args.epochs}}}
    # The pre-tokenized input: the text export's files, read back (one piece per step file).
    pretok_dir = work / "pretokenized"
    pretok = base | {"streams": {"code": {"paths": [str(pretok_dir)], "format": "export"}}}
    if "pre-tokenized" in kinds:
        export(text, work, have, "pretokenized")
        # (export() deleted the step files; write them again and keep them)
        subprocess.run([sys.executable, "-m", "service", "export", "--config",
                        str(work / "pretokenized.yaml"), "--out", str(pretok_dir)],
                       check=True, capture_output=True)  # fmt: skip
    if args.served:  # read as often as the steps need
        forever = {k: c | {"streams": {"code": c["streams"]["code"] | {"repeat": 1000}}}
                   for k, c in (("text", text), ("pre-tokenized", pretok)) if k in kinds}  # fmt: skip
        try:
            return run_served(forever, cores, work, args.steps, args.json, args.served_repeats,
                              args.steps_per_core, args.served_world, args.with_export,
                              args.lanes)  # fmt: skip
        finally:
            os.system(f"rm -rf {work}")
    fast = fastokens_rate(corpus_texts(corpus, 4 << 20))
    rows = []
    for kind, cfg in (("text", text), ("pre-tokenized", pretok)):
        if kind not in kinds:
            continue
        for n in cores:
            for lanes in sorted({1, n}):
                if BATCH % lanes:
                    continue
                runs = [export(cfg | {"lanes": lanes}, work, n, f"{kind}-{n}-{lanes}-{i}",
                               args.world_size) for i in range(args.repeats)]  # fmt: skip
                rows.append({"input": kind, "cores": n, "lanes": lanes,
                             **{k: statistics.median(r[k] for r in runs)
                                for k in ("steady", "end_to_end", "wall_s")},
                             "tokens": runs[0]["tokens"], "runs": runs})  # fmt: skip
    base_rate = {r["input"]: r["steady"] for r in rows if r["cores"] == 1 and r["lanes"] == 1}
    print(f"fastokens, one core, this process: {fast / 1e6:.2f}M tokens/s")
    head = (f"{'input':<14}{'cores':>6}{'lanes':>6}{'steady tok/s':>14}{'e2e tok/s':>12}"
            f"{'÷ N×1-core':>12}{'÷ N×fastokens':>15}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        one = base_rate.get(r["input"])  # no 1-core point: no scaling ratio
        r["scaling"] = None if one is None else r["steady"] / (r["cores"] * one)
        r["of_fastokens"] = r["steady"] / (r["cores"] * fast)
        scaling = "-" if r["scaling"] is None else f"{r['scaling']:.2f}"
        print(f"{r['input']:<14}{r['cores']:>6}{r['lanes']:>6}{r['steady']:>14,.0f}"
              f"{r['end_to_end']:>12,.0f}{scaling:>12}{r['of_fastokens']:>15.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"fastokens_1core": fast, "points": rows},
                                              indent=2) + "\n")  # fmt: skip
    os.system(f"rm -rf {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
