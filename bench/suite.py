"""`tokenmill bench`: tokenmill against the tokenizer limit and its peers, side by side.

    python -m bench [suite] [--quick] [--json PATH] [--mode bfd|concat]

Same run, same corpus (the demo corpus's `code.jsonl`: Python standard-library sources), same
tokenizer (tokenmill's default cl100k_base), rows of L = 2048 tokens, EOS after each document:

(a) the limit: one process encoding the corpus, batched, on one thread, × the N CPUs Ray has;
(b) `tokenmill export`: read + tokenize in Ray Data, pack in the feed actor, files written;
    with the default `tokenizer.backend: auto` (fastokens, else tiktoken, where verified exact), and again
    with `backend: hf` (the same HF tokenizer the peers use), so both effects show;
(c) HF `datasets.map(num_proc=N, batched=True)` + TRL `pack_dataset(strategy="bfd_split")`;
(d) a naive Ray Data pipeline: `read_json` → actor-pool `map_batches` (N actors) → concat;
(e) a torch `DataLoader(num_workers=N)` over a tokenizing, packing `IterableDataset`.

Every method's figure is real tokens delivered / wall time from its start to its last row,
start-up included (imports excluded). Each runs `repeats` times (quick: 1, full: 3) in
round-robin order, so slow drift on a shared machine falls on every method alike; the limit
is measured 3 times either way (it is cheap and it is every ratio's denominator). Every
figure is printed as a ratio to the limit and to each peer, never as an absolute bar.

First, unless `--no-e2e`: `bench/e2e.py`, each method a fresh process timed from its start to
its exit on ~100 MB (quick: ~12 MB) of the same code: the hand-written `multiprocessing.Pool`
+ tiktoken + concat + Parquet script against `tokenmill export` cold (it starts its own Ray)
and warm (`--address` to a running cluster). This is the comparison a user makes.

Also, on the same warm cluster: the first batch of a fresh feed and of feeds resumed early
and late in the demo mixture (bench/resume.py); the peak private RSS (driver + Ray workers)
and object-store bytes sampled during the tokenmill runs; and, with `--demo`, the trainer's
data-wait fraction in `tokenmill demo`.

Corpus. Quick: the first ~3 MB of `code.jsonl`, in a temporary file that every method reads
once. Full: all of `code.jsonl` (~11 MB) read 8 times (~22M tokens, so that start-up, which
every method pays, does not dominate): tokenmill with the stream's `repeat: 8` (each pass in a
new order), the peers from a temporary file holding the same bytes 8 times over, so every
method tokenizes the same documents.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.corpora import corpus_texts, single_process_rate
from bench.resume import warm_latencies

SEQ_LEN = 2048
QUICK_BYTES = 3 << 20
FULL_PASSES = 8
LIMIT_REPEATS = 3
TOKENMILL = "tokenmill"
TOKENMILL_HF = "tokenmill_hf"
PEERS = {  # name: (label, function name in bench.peers)
    "hf_trl": ("HF datasets.map + TRL bfd_split", "hf_datasets_trl"),
    "ray_data": ("naive Ray Data map_batches", "naive_ray_data"),
    "torch": ("torch DataLoader packing", "torch_dataloader"),
}


def _write_corpus(src: Path, dst: Path, limit_bytes: int | None, passes: int) -> int:
    """Copy whole lines of `src` (up to `limit_bytes` of text) `passes` times; return bytes."""
    lines, total = [], 0
    with open(src) as f:
        for line in f:
            lines.append(line)
            total += len(json.loads(line)["text"])
            if limit_bytes is not None and total >= limit_bytes:
                break
    with open(dst, "w") as out:
        for _ in range(passes):
            out.writelines(lines)
    return total


def _stats(values: list[float]) -> dict:
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / (2 * med) if med else 0.0,  # ± fraction
    }


def _run_tokenmill(cfg, out: Path) -> dict:
    from service.export import run_export

    try:
        s = run_export(cfg, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    x = s.export
    return {
        "tokens": s.real_tokens,
        "elapsed_s": x.elapsed_s,
        "time_to_first_step_s": x.time_to_first_step_s,
        "steady_tokens_per_s": x.steady_tokens_per_s,
        "packing_efficiency": s.packing_efficiency,
        "tokenizer_backend": s.tokenizer_backend,
    }


def _table(result: dict) -> str:
    limit = result["limit_tokens_per_s"]
    methods = result["methods"]
    peers = [p for p in PEERS if "median" in methods[p]]
    head = f"{'method':<36}{'tokens/s':>12}{'spread':>8}{'tokens':>12}{'×limit':>8}{'×best':>7}"
    head += "".join(f"{'×' + p:>10}" for p in peers)
    lines = [head, "-" * len(head)]

    def row(label, med, spread, tokens):
        best = methods[result["best_peer"]]["median"] if result["best_peer"] else None
        cells = f"{label:<36}{med:>12,.0f}{spread:>8}{tokens:>12}{med / limit:>8.2f}"
        cells += f"{med / best:>7.2f}" if best else f"{'-':>7}"
        return cells + "".join(f"{med / methods[p]['median']:>10.2f}" for p in peers)

    single = result["single_process"]
    lines.append(
        row(f"(a) limit: 1 process × {result['cpus']}", limit, f"±{single['spread']:.0%}", "")
    )
    lines.append(row("    one process", single["median"], f"±{single['spread']:.0%}", ""))
    for key, tag in zip([TOKENMILL, TOKENMILL_HF, *PEERS], ["b", "b'", "c", "d", "e"], strict=True):
        m = methods[key]
        if "median" not in m:
            lines.append(f"({tag}) {m['label']:<32}  skipped: {m['error']}")
            continue
        tokens = f"{statistics.median(m['tokens']):,.0f}"
        lines.append(row(f"({tag}) {m['label']}", m["median"], f"±{m['spread']:.0%}", tokens))
    return "\n".join(lines)


class MemorySampler:
    """Peak private RSS of the driver + Ray workers and object-store bytes, sampled at 2 Hz."""

    def __enter__(self):
        import threading

        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        from bench.memory import private_rss_total

        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        self.rss, self.store = 0, 0
        self._stop = threading.Event()

        def run():
            while not self._stop.is_set():
                used = get_memory_info_reply(state).store_stats.object_store_bytes_used
                total = private_rss_total()
                self.rss, self.store = max(self.rss, total), max(self.store, used)
                self._stop.wait(0.5)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def peaks(self) -> dict:
        return {"rss_peak": self.rss, "store_peak": self.store}


def _extras(result: dict) -> str:
    mb = 1 << 20
    ttfb = result["time_to_first_step_s"]
    w = result["warm"]
    steady = {
        k: statistics.median(r["steady_tokens_per_s"] for r in result["methods"][k]["runs"])
        for k in (TOKENMILL, TOKENMILL_HF)
        if result["methods"][k]["runs"]
    }
    limit = result["limit_tokens_per_s"]
    lines = [
        "",
        "tokenmill steady state (first block in to last step): "
        + ", ".join(f"{k}: {v:,.0f} tok/s = {v / limit:.2f}x limit" for k, v in steady.items()),
        "time to first step (export on the running Ray; Ray Data start included): "
        + ", ".join(f"{k}: " + "/".join(f"{x:.1f}s" for x in v) for k, v in ttfb.items()),
        f"warm cluster (demo mixture): first batch {w['first_batch_s']:.2f}s; resume "
        + ", ".join(f"at step {s}: {t:.2f}s" for s, t in w["resume_s"].items())
        + f" (late/early {w['late_over_early']:.2f})",
    ]
    if result["peak_private_rss_bytes"] is not None:
        lines.append(
            f"peak private RSS (driver + Ray workers) {result['peak_private_rss_bytes'] / mb:,.0f}"
            f" MB; peak object store {result['peak_object_store_bytes'] / mb:,.0f} MB"
        )
    if result["demo"]:
        d = result["demo"]
        lines.append(
            f"demo: trainer data-wait {d['data_wait_fraction']:.2%} of step time at steady state"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="tokenmill bench [suite]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="~3 MB corpus, one repeat")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--mode", choices=["bfd", "concat"], default="bfd", help="tokenmill's packing mode"
    )
    ap.add_argument("--demo", action="store_true", help="also run the demo for its data-wait")
    ap.add_argument("--no-e2e", action="store_true",
                    help="skip the end-to-end runs against the hand-written script (bench/e2e.py)")  # fmt: skip
    args = ap.parse_args(argv)
    e2e = None
    if not args.no_e2e:  # first, in fresh processes, before this process starts its own Ray
        from bench import e2e as e2e_bench

        print("end to end: the hand-written script, tokenmill cold and warm...", flush=True)
        e2e = e2e_bench.run(None, 1 if args.quick else 3, os.cpu_count() or 1,
                            QUICK_BYTES * 4 if args.quick else e2e_bench.TARGET_BYTES)  # fmt: skip

    import ray

    from bench import peers
    from client.cluster import connect
    from pipeline.read.resolve import parse_config
    from service.demo import demo_config
    from service.demo_corpus import build_demo_corpus

    code = build_demo_corpus() / "code.jsonl"
    work = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    repeats = 1 if args.quick else 3
    try:
        if args.quick:
            peer_file = work / "corpus.jsonl"
            corpus_bytes = _write_corpus(code, peer_file, QUICK_BYTES, 1)
            tm_paths, passes = [str(peer_file)], 1
        else:
            peer_file = work / f"corpus-x{FULL_PASSES}.jsonl"
            corpus_bytes = _write_corpus(code, peer_file, None, FULL_PASSES)
            tm_paths, passes = [str(code)], FULL_PASSES
        sample = corpus_texts(Path(tm_paths[0]), 4 << 20)
        print(f"corpus: {corpus_bytes / 1e6:.1f} MB of text × {passes} pass(es); L = {SEQ_LEN}")
        print("measuring the single-process tokenizer rate...", flush=True)
        single = single_process_rate(sample, LIMIT_REPEATS)

        connect()
        cpus = int(ray.cluster_resources().get("CPU", 1))
        cfg = parse_config(
            {
                "seq_len": SEQ_LEN,
                "global_batch_size": 16,
                "packing": {"mode": args.mode},
                "shuffle": {"window": 64},
                "streams": {"code": {"paths": tm_paths, "repeat": passes}},
            }
        )
        hf_cfg = cfg.model_copy(
            update={"tokenizer": cfg.tokenizer.model_copy(update={"backend": "hf"})}
        )
        methods = {
            TOKENMILL: {"label": f"tokenmill export ({args.mode})", "runs": []},
            TOKENMILL_HF: {"label": "  same, tokenizer.backend hf", "runs": []},
        }
        runners = {
            TOKENMILL: lambda i: _run_tokenmill(cfg, work / f"export-{i}"),
            TOKENMILL_HF: lambda i: _run_tokenmill(hf_cfg, work / f"export-hf-{i}"),
        }
        for key, (label, fn_name) in PEERS.items():
            methods[key] = {"label": label, "runs": []}
            fn = getattr(peers, fn_name)
            runners[key] = lambda i, fn=fn: fn(peer_file, SEQ_LEN, cpus)
        for i in range(repeats):
            for key, run in runners.items():
                m = methods[key]
                if "error" in m:
                    continue
                print(f"run {i + 1}/{repeats}: {m['label'].strip()}...", flush=True)
                try:
                    if key in (TOKENMILL, TOKENMILL_HF):
                        with MemorySampler() as mem:
                            m["runs"].append(run(i))
                        m["runs"][-1].update(mem.peaks())
                    else:
                        m["runs"].append(run(i))
                except ImportError as e:  # the peers' libraries are the optional `bench` extra
                    m["error"] = f"{e} (pip install 'tokenmill[bench]')"
                    print(f"  skipped: {m['error']}", flush=True)
        print("warm cluster: first batch and resume (demo mixture)...", flush=True)
        latency = warm_latencies(parse_config(demo_config(build_demo_corpus())), 60)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    demo = None
    if args.demo:
        from service.demo import run_demo

        print("demo (2 trainer ranks on CPU)...", flush=True)
        d = run_demo(steps=60)
        demo = {k: d[k] for k in ("data_wait_fraction", "tokens_per_s", "packing_efficiency")}

    limit = cpus * statistics.median(single)
    for m in methods.values():
        if m["runs"]:
            m["tokens_per_s"] = [r["tokens"] / r["elapsed_s"] for r in m["runs"]]
            m["tokens"] = [r["tokens"] for r in m["runs"]]
            m["elapsed_s"] = [r["elapsed_s"] for r in m["runs"]]
            m.update(_stats(m["tokens_per_s"]))
            m["over_limit"] = m["median"] / limit
    ran = [p for p in PEERS if "median" in methods[p]]
    tm_runs = methods[TOKENMILL]["runs"] + methods[TOKENMILL_HF]["runs"]
    best = max(ran, key=lambda p: methods[p]["median"]) if ran else None
    for m in methods.values():
        if "median" in m:
            m["over_peer"] = {p: m["median"] / methods[p]["median"] for p in ran}
            m["over_best_peer"] = m["median"] / methods[best]["median"] if best else None
    tm = methods[TOKENMILL]
    result = {
        "quick": args.quick,
        "seq_len": SEQ_LEN,
        "cpus": cpus,
        "repeats": repeats,
        "corpus_bytes": corpus_bytes,
        "corpus_passes": passes,
        "mode": args.mode,
        "single_process": {"tokens_per_s": single, **_stats(single)},
        "limit_tokens_per_s": limit,
        "methods": methods,
        "best_peer": best,
        "time_to_first_step_s": {
            k: [r["time_to_first_step_s"] for r in methods[k]["runs"]]
            for k in (TOKENMILL, TOKENMILL_HF)
        },
        "warm": latency,
        "tokenmill_steady_over_limit": {
            k: statistics.median(r["steady_tokens_per_s"] for r in methods[k]["runs"]) / limit
            for k in (TOKENMILL, TOKENMILL_HF)
            if methods[k]["runs"]
        },
        "peak_private_rss_bytes": max((r["rss_peak"] for r in tm_runs), default=None),
        "peak_object_store_bytes": max((r["store_peak"] for r in tm_runs), default=None),
        "demo": demo,
        "end_to_end": e2e,
        "bars": {  # the bars: ≥ 85% of the limit; ahead of every peer
            "tokenmill_over_limit": tm.get("over_limit"),
            "meets_85pct_of_limit": tm.get("over_limit", 0) >= 0.85,
            "ahead_of_every_peer": bool(ran) and tm.get("over_best_peer", 0) > 1.0,
        },
    }
    print()
    print(_table(result))
    print(_extras(result))
    if e2e is not None:
        from bench.e2e import table as e2e_table

        print(e2e_table(e2e))
    print(
        "\ntokens/s = real tokens delivered / wall time from start to last row (start-up"
        " included); spread = ±(max − min) / 2 / median over repeats; ×X = ratio to X's median."
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
