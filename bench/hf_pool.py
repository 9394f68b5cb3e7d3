"""`backend: hf` against its limit, on Ray Data tasks and on a warm pool (issue 15).

    python -m bench.hf_pool --corpus FILE.jsonl [FILE.jsonl ...] [--cpus 2]

The limit is `--cpus` × the single-process rate of the same code path (read + HF tokenize +
Arrow, `reading.iter_blocks_local`) on the corpus's first units, measured in this run. Then,
against one private `ray start --head`: three exports with `--pool N` (the first creates the
pool) and one on Ray Data tasks, each a fresh `tokenmill export` process; the figure is each
export's `steady_tokens_per_s` (summary.json) over the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.e2e import BIN, RayHead


def single_process_rate(cfg, units: int = 12) -> float:
    from pipeline.read.reading import iter_blocks_local
    from pipeline.stages.documents import DocSource
    from pipeline.tokenize.engines import load_tokenizer

    load_tokenizer(cfg.tokenizer)
    stream = cfg.streams["corpus"]
    todo = DocSource("corpus", 0, cfg, iter_blocks_local).units(0)[:units]
    t, n = time.perf_counter(), 0
    for block in iter_blocks_local(todo, stream, cfg.tokenizer):
        n += sum(len(c.values) for c in block.column("tokens").chunks)
    return n / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--corpus", nargs="+", required=True, help="JSONL files with `text`")
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="default: all cores")
    args = ap.parse_args(argv)
    from pipeline.read.resolve import parse_config

    config = {"seq_len": 2048, "global_batch_size": 16, "packing": {"mode": "concat"},
              "tokenizer": {"backend": "hf"},
              "streams": {"corpus": {"paths": [str(Path(f).resolve()) for f in args.corpus]}}}  # fmt: skip
    limit = args.cpus * single_process_rate(parse_config(config))
    print(f"limit: {args.cpus} x single-process hf = {limit:,.0f} tokens/s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="tokenmill-hf-"))
    head = RayHead(args.cpus)
    try:
        path = work / "hf.yaml"
        path.write_text(json.dumps(config))
        env = dict(os.environ, TOKENMILL_RAY_ADDRESS="", RAY_ADDRESS="")
        pool = ["--pool", str(args.cpus)]
        for i, (name, extra) in enumerate([("pool (creates it)", pool), ("pool", pool),
                                           ("pool", pool), ("Ray Data tasks", [])]):  # fmt: skip
            out = work / f"o{i}"
            cmd = [str(BIN / "tokenmill"), "export", "--config", str(path), "--out", str(out),
                   "--address", head.address, *extra]  # fmt: skip
            subprocess.run(cmd, env=env, capture_output=True, check=True)
            s = json.loads((out / "summary.json").read_text())
            steady = s["steady_tokens_per_s"]
            print(f"{name:<18} wall {s['wall_s']:6.2f}s  steady {steady:>11,.0f} tokens/s  "
                  f"= {steady / limit:.2f} x limit", flush=True)  # fmt: skip
    finally:
        head.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
