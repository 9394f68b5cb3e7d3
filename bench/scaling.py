"""Delivered tokens/s against the number of CPUs Ray has, with the limit line beside it.

    python -m bench scaling [--repeat-corpus N] [--json PATH] [--plot PNG]

Points, each a fresh Ray, the same `tokenmill export` (concat, L = 2048, files written):
  - one node with 1 CPU, then with 2 CPUs (this machine has 2 cores);
  - a simulated 2-node cluster (`ray.cluster_utils.Cluster`: a head with no CPUs holding the
    feed actor, and two worker nodes of 1 CPU each, each with its own object store), so blocks
    really cross object stores as they would between machines.
For each point the limit is N x the single-process HF tokenizer rate measured in the same run,
and the single-process tiktoken rate x N is drawn too (the fast backend's ceiling). Figures
are steady-state tokens/s (first tokenized block in to last step) and end to end (start-up
included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.corpora import corpus_texts, single_process_rate


def _fast_rate(texts: list[str], repeats: int) -> list[float]:
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    tok = load_tokenizer(TokenizerConfig(backend="tiktoken"))  # the bar is tiktoken's rate
    assert tok.fast is not None
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = sum(len(x) for x in tok.fast.encode(texts))
        rates.append(n / (time.perf_counter() - t))
    return rates


def _export(cfg, work: Path, tag: str) -> dict:
    from bench.suite import _run_tokenmill

    r = _run_tokenmill(cfg, work / tag)
    return r | {"end_to_end_tokens_per_s": r["tokens"] / r["elapsed_s"]}


def _point(label: str, cpus: int, start, stop, cfg, work: Path, repeats: int) -> list[dict]:
    """One cluster shape; the export with the default backend and with `backend: hf`."""
    hf_cfg = cfg.model_copy(
        update={"tokenizer": cfg.tokenizer.model_copy(update={"backend": "hf"})}
    )
    start()
    try:
        out = []
        for backend, c in (("auto", cfg), ("hf", hf_cfg)):
            runs = [_export(c, work, f"{label}-{backend}-{i}") for i in range(repeats)]
            out.append(
                {
                    "label": label,
                    "backend": backend,
                    "cpus": cpus,
                    "runs": runs,
                    "steady_median": statistics.median(r["steady_tokens_per_s"] for r in runs),
                    "end_to_end_median": statistics.median(
                        r["end_to_end_tokens_per_s"] for r in runs
                    ),
                }
            )
        return out
    finally:
        stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scaling", description=__doc__)
    ap.add_argument("--repeat-corpus", type=int, default=12, help="epochs of code.jsonl")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write a PNG plot here")
    args = ap.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from pipeline.read.resolve import parse_config
    from service.demo_corpus import build_demo_corpus

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local throwaway clusters only
    code = build_demo_corpus() / "code.jsonl"
    sample = corpus_texts(code, 4 << 20)
    hf = statistics.median(single_process_rate(sample, 3))
    fast = statistics.median(_fast_rate(sample, 3))
    cfg = parse_config(
        {
            "seq_len": 2048,
            "global_batch_size": 16,
            "packing": {"mode": "concat"},
            "shuffle": {"window": 64},
            "streams": {"code": {"paths": [str(code)], "repeat": args.repeat_corpus}},
        }
    )
    work = Path(tempfile.mkdtemp(prefix="tokenmill-scaling-"))
    store = 512 << 20
    points = []
    for n in (1, 2):
        points.extend(
            _point(
                f"1 node, {n} CPU",
                n,
                lambda n=n: ray.init(
                    address="local", num_cpus=n, object_store_memory=store, include_dashboard=False
                ),
                ray.shutdown,
                cfg,
                work,
                args.repeats,
            )
        )
    cluster = None

    def start_cluster():
        nonlocal cluster
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "object_store_memory": store},
        )
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address)

    def stop_cluster():
        ray.shutdown()
        cluster.shutdown()

    points.extend(
        _point("2 nodes x 1 CPU (simulated)", 2, start_cluster, stop_cluster, cfg, work, 1)
    )
    shutil.rmtree(work, ignore_errors=True)
    result = {"single_process_hf": hf, "single_process_tiktoken": fast, "points": points}
    print(f"single process: HF {hf:,.0f} tok/s, tiktoken {fast:,.0f} tok/s")
    print(
        f"{'point':<30}{'backend':>8}{'steady tok/s':>14}{'×limit':>8}{'end-to-end':>12}{'×limit':>8}"
    )
    for p in points:
        limit = p["cpus"] * hf
        p["steady_over_limit"] = p["steady_median"] / limit
        p["end_to_end_over_limit"] = p["end_to_end_median"] / limit
        print(
            f"{p['label']:<30}{p['backend']:>8}{p['steady_median']:>14,.0f}{p['steady_over_limit']:>8.2f}"
            f"{p['end_to_end_median']:>12,.0f}{p['end_to_end_over_limit']:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hf, fast = result["single_process_hf"], result["single_process_tiktoken"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [0, 1, 2]
    ax.plot(xs, [x * hf / 1e6 for x in xs], "k--", label="limit: N x single-process HF")
    ax.plot(
        xs, [x * fast / 1e6 for x in xs], ":", color="grey", label="N x single-process tiktoken"
    )
    for backend, color in (("auto", "C0"), ("hf", "C2")):
        one = [
            p
            for p in result["points"]
            if p["label"].startswith("1 node") and p["backend"] == backend
        ]
        name = "tokenmill, backend " + backend
        xs1 = [p["cpus"] for p in one]
        ax.plot(
            xs1, [p["steady_median"] / 1e6 for p in one], "o-", color=color, label=f"{name}: steady"
        )
        ax.plot(
            xs1,
            [p["end_to_end_median"] / 1e6 for p in one],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{name}: end to end",
        )
        for p in result["points"]:
            if not p["label"].startswith("1 node") and p["backend"] == backend:
                ax.plot(
                    [p["cpus"]],
                    [p["steady_median"] / 1e6],
                    "D",
                    color=color,
                    label=f"{name}: {p['label']}, steady",
                )
    ax.set_xlabel("CPUs (Ray workers)")
    ax.set_ylabel("million tokens / s")
    ax.set_xticks([1, 2])
    ax.set_xlim(0, 2.3)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("tokenize + pack + write, cl100k, L = 2048 (2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
