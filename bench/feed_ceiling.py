"""The feed's own ceiling: packing and writing with every block already tokenized.

    python -m bench feed-ceiling [--corpus FILE.jsonl] [--mb 40] [--json PATH]

The blocks of a corpus are tokenized once, in this process, and kept in memory; then a StepFeed
is run over them with an executor that hands them out instantly, so what is timed is only
what one feed does per token: the windowed shuffle, mixing, packing (concat and bfd),
building steps, and, for the export, writing them (compact layout, Parquet, one file per
step). The result divided by a worker's tokenizing rate says how many workers one feed can
absorb before several feeds over disjoint shard sets are needed (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

SEQ_LEN = 2048


def _corpus(path: Path | None, mb: int, work: Path) -> Path:
    if path is not None:
        return path
    from service.demo_corpus import build_demo_corpus

    code = (build_demo_corpus() / "code.jsonl").read_bytes()
    out = work / "corpus.jsonl"
    out.write_bytes(code * max(1, round((mb << 20) / len(code))))
    return out


def run(corpus: Path, mode: str, write: bool, work: Path) -> dict:
    from pipeline.feed import StepFeed
    from pipeline.read.reading import iter_blocks_local
    from pipeline.read.resolve import parse_config
    from wire.layout import compact, step_path, write_step

    cfg = parse_config({"seq_len": SEQ_LEN, "global_batch_size": 16, "packing": {"mode": mode},
                        "streams": {"s": {"paths": [str(corpus)]}}})  # fmt: skip
    units = StepFeed(cfg, executor=iter_blocks_local).streams[0].units(0)
    t = time.perf_counter()
    blocks = {u.index: list(iter_blocks_local([u], cfg.streams["s"], cfg.tokenizer)) for u in units}
    tokenize_s = time.perf_counter() - t

    def cached(us, stream, tok):  # every block ready: the feed alone is timed
        for u in us:
            yield from blocks[u.index]

    out = work / f"out-{mode}"
    out.mkdir(exist_ok=True)
    t = time.perf_counter()
    feed = StepFeed(cfg, executor=cached)
    feed.full_batches = False  # as the export builds them (compact layout)
    while (batch := feed.next_step()) is not None:
        if write:  # what the export does with a step
            step = int(batch.schema.metadata[b"global_step"])
            write_step(compact(batch, False), step_path(out, step, 0, "parquet"), "parquet")
    elapsed = time.perf_counter() - t
    tokens = feed.real_tokens
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "write": write, "tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "tokenize_one_core_tokens_per_s": tokens / tokenize_s}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench feed-ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--corpus", type=Path, default=None, help="JSONL (default: the demo code)")
    ap.add_argument("--mb", type=int, default=40, help="corpus size without --corpus")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tokenmill-ceiling-"))
    try:
        corpus = _corpus(args.corpus, args.mb, work)
        results = [run(corpus, mode, False, work) for mode in ("concat", "bfd")]
        results.append(run(corpus, "concat", True, work))
        results.append(run(corpus, "bfd", True, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in results:
        what = "pack + build + write (the export's feed)" if r["write"] else "pack + build"
        print(f"{r['mode']:<7} {what:<52} {r['tokens_per_s']:>12,.0f} tokens/s")
    tok = results[0]["tokenize_one_core_tokens_per_s"]
    ceiling = results[0]["tokens_per_s"]
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    fast = load_tokenizer(TokenizerConfig()).fast  # the engine `auto` chose here
    engine = "hf" if fast is None else fast.name
    print(
        f"one core tokenizing ({engine}, read + verify + Arrow): {tok:,.0f} tokens/s -> one feed"
        f" packs for ~{ceiling / tok:.0f} such workers before it is the bottleneck"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
