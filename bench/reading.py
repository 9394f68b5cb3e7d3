"""Reading pre-tokenized input: an export's step files read back as documents, one core.

    python -m bench reading [--epochs 8] [--repeats 3] [--json PATH]

The demo corpus's code.jsonl is exported in this process (L 2048, G 32, compact Parquet, one
file per step), and its files are then read back as a `format: export` source: each unit
through `tokenize_unit`, the body of a read task and of a lane's own reading. Two unit sizes:
the default (`read.block_bytes`, ramping up from `read.first_block_bytes`) and one file per
unit. The baseline, measured in the same run on the same texts: fastokens encoding them on
one thread (what reading the text itself would cost in tokenizing alone). Best of `repeats`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

SEQ_LEN, BATCH = 2048, 32


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench reading", description=__doc__)
    ap.add_argument("--epochs", type=int, default=8, help="passes over code.jsonl exported")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from bench.corpora import corpus_texts
    from bench.lanes import fastokens_rate
    from pipeline.read.reading import Unit, group_units, iter_blocks_local, tokenize_unit
    from pipeline.read.resolve import parse_config
    from pipeline.read.sources import plan_pieces
    from pipeline.tokenize.engines import load_tokenizer
    from service.demo_corpus import build_demo_corpus
    from service.export import run_export

    corpus = build_demo_corpus() / "code.jsonl"
    work = Path(tempfile.mkdtemp(prefix="bench-reading-"))
    base = {"seq_len": SEQ_LEN, "global_batch_size": BATCH, "packing": {"mode": "concat"}}
    text = base | {"streams": {"code": {"paths": [str(corpus)], "repeat": args.epochs}}}
    run_export(parse_config(text), work / "export", executor=iter_blocks_local)
    cfg = parse_config(base | {"streams": {"code": {"paths": [str(work / "export")],
                                                    "format": "export"}}})  # fmt: skip
    stream = cfg.streams["code"]
    tok = load_tokenizer(cfg.tokenizer)
    pieces = [p for ps in plan_pieces(stream.paths, "export", cfg.read.piece_bytes) for p in ps]
    layouts = {
        f"default units ({cfg.read.block_bytes >> 20} MiB)": group_units(
            pieces, cfg.read.block_bytes, cfg.read.first_block_bytes
        ),
        "one file per unit": [Unit(i, (p,)) for i, p in enumerate(pieces)],
    }
    rows = {}
    for name, units in layouts.items():
        best, tokens = float("inf"), 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            tokens = sum(len(c.values) for u in units
                         for c in tokenize_unit(u, stream, tok).column("tokens").chunks)  # fmt: skip
            best = min(best, time.perf_counter() - t)
        rows[name] = {"units": len(units), "tokens": tokens, "seconds": best,
                      "tokens_per_s": tokens / best}  # fmt: skip
    fast = fastokens_rate(corpus_texts(corpus, 4 << 20), args.repeats)
    print(f"{len(pieces)} step files, one core; fastokens on the same texts: "
          f"{fast / 1e6:.2f}M tokens/s")  # fmt: skip
    print(f"{'units':<26}{'count':>7}{'tokens/s':>14}{'÷ fastokens':>13}{'ms per file':>13}")
    for name, r in rows.items():
        r["of_fastokens"] = r["tokens_per_s"] / fast
        print(f"{name:<26}{r['units']:>7}{r['tokens_per_s']:>14,.0f}{r['of_fastokens']:>13.2f}"
              f"{1e3 * r['seconds'] / len(pieces):>13.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"fastokens": fast, "rows": rows}, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
