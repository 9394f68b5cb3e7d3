"""Throughput of `tokenmill export` against the single-process tokenizer rate, same run.

    python -m bench.throughput [--quick] [--json PATH] [--mode concat|bfd]

(a) the limit: one process encoding the corpus with the same HF tokenizer, batched, one
    thread, measured here and multiplied by the number of CPUs Ray has;
(b) tokenmill export over the same corpus (read + tokenize in Ray Data, pack in the feed
    actor, files written), tokens/s from its first step to its last.
Both are reported as ratios, never as absolute bars: this machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def corpus_texts(path: Path, limit_bytes: int) -> list[str]:
    texts, total = [], 0
    with open(path) as f:
        for line in f:
            t = json.loads(line)["text"]
            texts.append(t)
            total += len(t)
            if total >= limit_bytes:
                break
    return texts


def single_process_rate(texts: list[str], repeats: int) -> list[float]:
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    os.environ["RAYON_NUM_THREADS"] = "1"
    tok = load_tokenizer(TokenizerConfig())
    tok.encode(texts[:2])  # warm up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        flat, _ = tok.encode(texts)
        rates.append(len(flat) / (time.perf_counter() - t))
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mode", choices=["concat", "bfd"], default="concat")
    args = ap.parse_args(argv)

    import ray

    from client.cluster import connect
    from pipeline.read.resolve import parse_config
    from service.demo_corpus import build_demo_corpus
    from service.export import run_export

    size = (8 if args.quick else 48) << 20
    corpus = build_demo_corpus(limit_bytes=size)
    work = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    texts = corpus_texts(corpus / "code.jsonl", size)
    sample = corpus_texts(corpus / "code.jsonl", 4 << 20)
    repeats = 2 if args.quick else 3
    single = single_process_rate(sample, repeats)

    connect()
    cpus = int(ray.cluster_resources().get("CPU", 1))
    cfg = parse_config(
        {
            "seq_len": 2048,
            "global_batch_size": 16,
            "packing": {"mode": args.mode},
            "shuffle": {"window": 64},
            # The standard library is ~11 MB of source: read it several times (each epoch is
            # re-read and re-tokenized in a new order) so that start-up is amortized.
            "streams": {
                "code": {"paths": [str(corpus / "code.jsonl")], "repeat": 1 if args.quick else 4}
            },
        }
    )
    runs = []
    for i in range(repeats):
        s = run_export(cfg, work / f"out{i}")
        runs.append(s)
    ray.shutdown()

    limit_rate = cpus * statistics.median(single)
    # End to end: every token over the whole export, start-up included (the conservative figure).
    export_rates = [r.real_tokens / r.export.elapsed_s for r in runs]
    result = {
        "corpus_bytes": sum(len(t) for t in texts),
        "corpus_tokens": runs[-1].real_tokens,
        "cpus": cpus,
        "single_process_tokens_per_s": single,
        "limit_tokens_per_s": limit_rate,
        "export_tokens_per_s": export_rates,
        "export_over_limit": [r / limit_rate for r in export_rates],
        "export_over_limit_median": statistics.median(export_rates) / limit_rate,
        "export_steady_tokens_per_s": [r.export.steady_tokens_per_s for r in runs],
        "export_elapsed_s": [r.export.elapsed_s for r in runs],
        "time_to_first_step_s": [r.export.time_to_first_step_s for r in runs],
        "packing_efficiency": runs[-1].packing_efficiency,
        "mode": args.mode,
    }
    print(
        f"single-process tokenizer: {statistics.median(single):,.0f} tok/s (x{cpus} cpus = {limit_rate:,.0f})"
    )
    print(f"tokenmill export:         {statistics.median(export_rates):,.0f} tok/s (runs: "
          + ", ".join(f"{r:,.0f}" for r in export_rates) + ")")  # fmt: skip
    print(f"ratio to the limit:       {result['export_over_limit_median']:.2f} (spread "
          + ", ".join(f"{r:.2f}" for r in result["export_over_limit"]) + ")")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
