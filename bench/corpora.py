"""Text corpora for the benches, built from this machine's Python files (no download).

    python -m bench.corpora [--mb 128]        # builds (once) and prints the site-packages corpus

Two corpora, both JSONL of `{"text": source, "path": relative path}`:

- the demo corpus (`service.demo_corpus`): the running Python's standard library, without
  its tests: ~11 MB in ~580 documents;
- the site-packages corpus (`site_packages_corpus`): the `.py` files of the running Python's
  site-packages (Ray, pyarrow, numpy, torch, ... as installed), in an order fixed by a digest
  of each file's path, up to `mb` MiB: 128 MiB is ~10,000 documents here.

Why a second one: K lanes serve at the pace of the slowest lane (every global step needs all
K), and a lane reads a fixed share of each stream's pieces. The demo corpus split 16 ways is
~36 documents a lane, a few of them hundreds of kB, so a lane's share is a handful of files,
and the shares differ in characters per token and in what the HF check covers: each lane
alone on a core, the fastest made ×1.31–1.35 the slowest's tokens/s
(`python -m bench lane-rates --lanes 16`). A corpus of the size lanes are for gives every
lane hundreds of documents: ×1.08–1.13 over the same code. Benches that measure lanes at many
cores take `--corpus site-packages` (or `site-packages:MB`): the corpus a user with lanes
has is the large one. It differs between machines (what is installed), so compare ratios,
each measured in one run, not absolute figures across machines.

Also the texts and the single-process rate that the benches' limits are measured with
(`corpus_texts`, `single_process_rate`: the default tokenizer on one thread, in this process).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

SITE_PACKAGES = "site-packages"
DEFAULT_MB = 128


def site_packages_corpus(mb: int = DEFAULT_MB, out_dir: str | Path | None = None) -> Path:
    """Write (once) and return a JSONL file of this Python's site-packages sources, up to `mb`
    MiB of text, in an order fixed by a digest of each file's relative path (so the files of
    one package are spread over the corpus, as a shuffled crawl would have them)."""
    if out_dir is None:
        from pipeline.tokenize.files import cache_dir

        out_dir = cache_dir() / "bench"
    v = sys.version_info
    path = Path(out_dir) / f"site-packages-py{v.major}{v.minor}-{mb}m.jsonl"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["purelib"])
    found = sorted(
        (hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), p)
        for p in root.rglob("*.py")
        if p.is_file() and p.stat().st_size > 0
    )
    limit, total = mb << 20, 0
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "w") as out:
        for _, p in found:
            try:
                source = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if total + len(source) > limit:
                continue
            out.write(json.dumps({"text": source, "path": str(p.relative_to(root))}) + "\n")
            total += len(source)
    if total == 0:
        tmp.unlink()
        raise SystemExit(f"no Python sources under {root}: pass --corpus FILE.jsonl")
    os.replace(tmp, path)
    return path


def resolve_corpus(arg: str | None) -> Path:
    """A bench's `--corpus`: a JSONL file, `site-packages[:MB]`, or None (the demo corpus's
    code.jsonl)."""
    if arg is None:
        from service.demo_corpus import build_demo_corpus

        return build_demo_corpus() / "code.jsonl"
    name, _, mb = arg.partition(":")
    if name == SITE_PACKAGES:
        return site_packages_corpus(int(mb) if mb else DEFAULT_MB)
    return Path(arg)


def corpus_texts(path: Path, limit_bytes: int) -> list[str]:
    """The `text` of a JSONL file's first documents, up to `limit_bytes` characters."""
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
    """The default tokenizer's tokens/s on `texts` in this process, on one thread, `repeats`
    times: the limit's single-process rate."""
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
    ap.add_argument("--mb", type=int, default=DEFAULT_MB, help="MiB of text (default 128)")
    args = ap.parse_args(argv)
    path = site_packages_corpus(args.mb)
    with open(path) as f:
        docs = sum(1 for _ in f)
    print(f"{path}: {docs:,} documents, {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
