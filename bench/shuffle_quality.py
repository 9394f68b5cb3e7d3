"""Shuffle quality on a corpus sorted by a label (issue 26): `python -m bench shuffle`.

The corpus is one JSONL of `--sources` equal sources (documents of random words, 0.6-6 KB),
sorted by source, as a dump ordered by domain or date is. For each shuffle, in a process of
its own (so its peak memory is its own), the bench reads one epoch through the stream's
shuffle stages (DocSource -> WindowShuffle: what the packer takes) and reports, with the
epoch cut into 20 windows of 5% of its tokens:

- `first_top`: the largest share of one source's tokens in the first 5%;
- `max_top`: that share in the worst 5% window;
- `mean_tv`: the mean total-variation distance between a window's source mix and the corpus's;
- `first_step_s`: a StepFeed's time to its first global step (in-process tokenizer, loaded
  before; the median of 3, after the epoch);
- `epoch_s`: the epoch's read through the shuffle (tokenizing in this process included, under
  tracemalloc);
- `epoch_peak_mb`: the most memory allocated at once during the epoch's read (tracemalloc,
  which sees the numpy buffers that the blocks' tokens live in, and every Python object): the
  blocks the stream holds, open pieces included (the resident size hides it: the tokenizer's
  load leaves freed memory that the read reuses);
- `resume_s`: a StepFeed's time from a state at step 600 (~40% of the default corpus) to its
  next step (the open pieces, the window and the packer's pool re-read); `state_bytes`;
- `peak_rss_mb`: the process's peak resident memory over the first steps and the epoch,
  and `base_rss_mb` with the tokenizer loaded, before reading.

Shuffles: `old` (`shuffle.pieces: 0`: seeded file order, pieces in order, the 256-document
window: the shuffle before issue 26), `new` (the defaults), `global` (a seeded permutation of
all documents: the reference, computed from the file order; not a streaming shuffle, so no
time or memory for it). Goal with the defaults: `max_top` <= 0.15 with 10 sources.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or have an they which "
    "one you were all we when there can more if no out so said what up its about into than "
    "them only some could new these two may first then do any like my now over such our man"
)
WORDS = _WORDS.split()
RESUME_AT = 600  # steps of 16 x 1024 tokens: ~40% of the 97 MB corpus's epoch
SHUFFLES = {
    "old": {"pieces": 0},
    "new": {},
    "global": {"files": False, "window": 1},  # file order, permuted here
}


def write_corpus(path: Path, mb: float, sources: int, seed: int = 26) -> int:
    """One JSONL sorted by `source`, about `mb` MB, `sources` equal parts. Returns the
    documents per source."""
    rng = random.Random(seed)
    per_source = max(1, int(mb * 1e6 / 3200 / sources))  # ~3.2 KB per document
    with open(path, "w") as f:
        for label in range(sources):
            for _ in range(per_source):
                text = " ".join(rng.choices(WORDS, k=rng.randint(150, 1350)))
                f.write(json.dumps({"source": label, "text": f"source {label}: {text}"}) + "\n")
    return per_source


def config(corpus: Path, shuffle: dict, seed: int = 0):
    from pipeline.read.resolve import parse_config

    return parse_config(
        {
            "seed": seed,
            "seq_len": 1024,
            "global_batch_size": 16,
            "shuffle": shuffle,
            "streams": {"corpus": {"paths": [str(corpus)]}},
        }
    )


def windows(labels: np.ndarray, tokens: np.ndarray, sources: int, parts: int = 20) -> dict:
    """Top-source share and total-variation distance per 5% window of the tokens."""
    cum = np.cumsum(tokens) - tokens  # tokens before each document
    which = np.minimum((cum * parts) // max(1, int(tokens.sum())), parts - 1)
    corpus = np.bincount(labels, weights=tokens, minlength=sources) / tokens.sum()
    tops, tvs = [], []
    for w in range(parts):
        mask = which == w
        mix = np.bincount(labels[mask], weights=tokens[mask], minlength=sources)
        mix = mix / max(mix.sum(), 1)
        tops.append(float(mix.max()))
        tvs.append(float(0.5 * np.abs(mix - corpus).sum()))
    return {
        "first_top": round(tops[0], 3),
        "max_top": round(max(tops), 3),
        "mean_tv": round(float(np.mean(tvs)), 3),
        "tops": [round(t, 3) for t in tops],
    }


def child(corpus: Path, name: str, per_source: int, sources: int, seed: int) -> dict:
    """One shuffle's figures (run in its own process)."""
    from pipeline.feed import StepFeed
    from pipeline.read.reading import iter_blocks_local
    from pipeline.stages.documents import DocSource
    from pipeline.stages.shuffle import WindowShuffle
    from pipeline.tokenize.engines import load_tokenizer

    cfg = config(corpus, SHUFFLES[name], seed)
    load_tokenizer(cfg.tokenizer)  # its memory is not the shuffle's
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out: dict = {"shuffle": name, "settings": cfg.shuffle.model_dump()}
    source = DocSource("corpus", 0, cfg, iter_blocks_local)
    source.start()
    records, lengths = [], []
    tracemalloc.start()
    t0 = time.monotonic()
    for doc in WindowShuffle(source, cfg.shuffle.window, cfg.seed, "corpus"):
        records.append(doc.doc_id & 0xFFFFFFFF)
        lengths.append(len(doc))
    out["epoch_s"] = round(time.monotonic() - t0, 1)  # under tracemalloc: slower
    out["epoch_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20)
    tracemalloc.stop()
    if name != "global":
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            feed = StepFeed(cfg, executor=iter_blocks_local)
            feed.next_step()
            times.append(time.monotonic() - t0)
            feed.close()
        out["first_step_s"] = round(sorted(times)[1], 2)
        feed = StepFeed(cfg, executor=iter_blocks_local)
        for _ in range(RESUME_AT):
            feed.next_step()
        state = feed.get_state()
        feed.close()
        t0 = time.monotonic()
        resumed = StepFeed(cfg, executor=iter_blocks_local, state=state)
        resumed.next_step()
        out["resume_s"] = round(time.monotonic() - t0, 2)
        out["state_bytes"] = len(json.dumps(state))
        resumed.close()
    labels, tokens = np.array(records) // per_source, np.array(lengths)
    if name == "global":
        order = np.random.default_rng(seed).permutation(len(labels))
        labels, tokens = labels[order], tokens[order]
    else:
        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        out["base_rss_mb"] = round(base)
    out["docs"] = len(labels)
    return out | windows(labels, tokens, sources)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench shuffle", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--mb", type=float, default=97.0, help="corpus size (default 97 MB)")
    ap.add_argument("--sources", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shuffles", default="old,new,global")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--per-source", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.corpus, args.child, args.per_source, args.sources,
                               args.seed)))  # fmt: skip
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "sorted.jsonl"
        per_source = write_corpus(corpus, args.mb, args.sources)
        size = corpus.stat().st_size / 1e6
        print(f"corpus: {size:.1f} MB, {args.sources} sources x {per_source} documents, sorted")
        for name in args.shuffles.split(","):
            cmd = [sys.executable, "-m", "bench.shuffle_quality", "--child", name, "--corpus",
                   str(corpus), "--per-source", str(per_source), "--sources", str(args.sources),
                   "--seed", str(args.seed)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            print(
                f"{name:>6}: first 5% top {r['first_top']:.3f}  worst 5% top {r['max_top']:.3f}"
                f"  mean TV {r['mean_tv']:.3f}  first step {r.get('first_step_s', '-')} s"
                f"  epoch {r['epoch_s']} s, peak {r['epoch_peak_mb']} MB"
                f"  resume {r.get('resume_s', '-')} s (state {r.get('state_bytes', '-')} B)"
                f"  peak RSS {r.get('peak_rss_mb', '-')} MB (base {r.get('base_rss_mb', '-')})"
            )
    if args.json:
        args.json.write_text(json.dumps({"corpus_mb": round(size, 1), "results": results},
                                        indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
