"""`tokenmill check` and `tokenmill stats`: what a config will make, before a run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.read.resolve import load_config


def _check_lanes(cfg) -> bool:
    """Whether every lane gets pieces of every stream; each stream's share per lane printed."""
    from pipeline.stages.documents import DocSource

    ok = True
    for i, name in enumerate(cfg.streams):
        try:
            source = DocSource(name, i, cfg, executor=None, lane=0)  # type: ignore[arg-type]
            lanes = source.piece_lanes()
        except ValueError as e:
            print(f"BAD lanes: {e}", file=sys.stderr)
            ok = False
            continue
        work = [p.work for per_file in source.pieces() for p in per_file]
        per = [sum(w for w, k in zip(work, lanes, strict=True) if k == lane)
               for lane in range(cfg.lanes)]  # fmt: skip
        print(f"  {name}: {len(work)} pieces over {cfg.lanes} lanes, "
              f"{min(per):,}-{max(per):,} bytes each")  # fmt: skip
    return ok


def cmd_check(args) -> int:
    """Validate the config, load the tokenizer, then read and tokenize every record once:
    the bad ones listed (the first `--show` of each stream) and counted, the good ones
    counted with their tokens, and the steps they make at the configured weights."""
    from pipeline.inspect.stats import count_corpus, supply
    from pipeline.tokenize.engines import load_tokenizer

    cfg = load_config(args.config)
    print(f"config ok: {len(cfg.streams)} stream(s), hash {cfg.config_hash()}")
    for name, s in cfg.streams.items():
        print(f"  {name}: {s.kind}, {s.format}, {len(s.paths)} path(s), weight {s.weight}")
    try:  # the tokenizer every worker will load: a bad name fails here, in seconds
        tok = load_tokenizer(cfg.tokenizer)
    except ValueError as e:
        print(f"BAD tokenizer: {e}", file=sys.stderr)
        return 1
    print(f"tokenizer ok: {tok.describe()}")
    if cfg.lanes > 1 and not _check_lanes(cfg):
        return 1
    listed: dict[str, int] = dict.fromkeys(cfg.streams, 0)

    def show(rej) -> None:
        listed[rej.stream] += 1
        if listed[rej.stream] <= args.show:
            where = rej.file + ("" if rej.record is None else f":{rej.record}")
            print(f"BAD {rej.stream}: {where}: {rej.reason}")

    counts = count_corpus(cfg, show)
    for name, c in counts.items():
        print(
            f"{name}: {c.records:,} records, {c.docs:,} ok, {c.bad:,} bad; "
            f"{c.tokens:,} tokens in one pass"
        )
    _print_supply(cfg, supply(cfg, counts))
    _print_lane_pace(cfg, counts)
    bad = {name: c.bad for name, c in counts.items() if c.bad}
    for name, n in bad.items():
        more = f" ({n - args.show} not listed)" if n > args.show else ""
        print(f"{name}: {n} bad record(s){more}", file=sys.stderr)
    if bad:
        return 1
    records = sum(c.records for c in counts.values())
    tokens = sum(c.tokens for c in counts.values())
    print(f"all {records:,} records ok ({tokens:,} tokens)")
    return 0


def _print_lane_pace(cfg, counts) -> None:
    """With lanes: how far apart the lanes' shares are in bytes read per token served (the
    slowest lane sets the pace of all: every global step needs each lane's rows)."""
    from pipeline.inspect.stats import lane_pace

    pace = lane_pace(cfg, counts)
    if pace is None:
        return
    slow = max(range(len(pace)), key=pace.__getitem__)
    fast = min(range(len(pace)), key=pace.__getitem__)
    mean = sum(pace) / len(pace)
    print(
        f"lanes: bytes read per token served, at the configured weights: {pace[fast]:.2f} "
        f"(lane {fast}) to {pace[slow]:.2f} (lane {slow}), x{pace[slow] / pace[fast]:.2f} apart "
        f"(mean {mean:.2f})"
    )
    print(
        f"  a lane reads and tokenizes by the byte and serves tokens: expect lane {slow} to "
        f"be the slowest, and the {cfg.lanes} lanes to serve at its pace, by this measure "
        f"~{mean / pace[slow]:.2f} of the mean lane's (more data per lane, or fewer lanes, "
        "evens the shares out; `python -m bench.lane_rates` measures each lane)"
    )


def _print_supply(cfg, sup: dict) -> None:
    G, L = cfg.global_batch_size, cfg.seq_len
    weights = ", ".join(f"{n} {w:.3f}" for n, w in sup["weights"].items())
    print(
        f"steps at the configured weights ({weights}), {G} rows x {L} tokens = "
        f"{sup['tokens_per_step']:,} tokens a step:"
    )
    for name, steps in sup["pass_steps"].items():
        print(f"  {name}: one pass lasts {steps:,} steps")
    print(
        f"  one epoch (until the first stream, {sup['epoch_ends_with']!r}, has been read once): "
        f"{sup['epoch_steps']:,} steps"
    )
    repeats = ", ".join(
        f"{n} x{s.repeat}" + ("" if s.max_tokens is None else f" (max {s.max_tokens:,} tokens)")
        for n, s in cfg.streams.items()
    )
    how = (
        f"ends when {sup['first_dry']!r} runs dry (on_exhausted: stop)"
        if cfg.mixing.on_exhausted == "stop"
        else "ends when every stream has run dry (on_exhausted: renormalize)"
    )
    print(f"  the whole run (repeat: {repeats}): {sup['run_steps']:,} steps; the data {how}")
    print(
        "  (full rows: the padding packing leaves in a row stretches the data over as many "
        "more steps)"
    )


def cmd_stats(args) -> int:
    """Per stream, the token lengths of a sample of documents; for the mixture, one seq_len."""
    from pipeline.inspect.stats import mixture_seq_len, sample_lengths, text_histogram
    from pipeline.state.summary import describe_lengths

    cfg = load_config(args.config)
    samples = sample_lengths(cfg, docs=args.docs)
    stats = {
        name: describe_lengths(lengths) | {"skipped_while_sampling": skipped}
        for name, (lengths, skipped) in samples.items()
    }
    mix = mixture_seq_len({n: a for n, (a, _) in samples.items()}, cfg.weights, args.fit)
    if args.json:
        doc = {"streams": stats, "mixture": mix}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    for name, st in stats.items():
        print(f"stream {name}: {st['docs']} docs sampled")
        if st["skipped_while_sampling"]:
            print(
                f"  {st['skipped_while_sampling']} bad record(s) skipped while sampling "
                "(`tokenmill check` lists them)"
            )
        if not st["docs"]:
            continue
        print(
            f"  tokens/doc  mean {st['mean']:.1f} ± {st['std']:.1f}   p50 {st['p50']:.0f}  "
            f"p90 {st['p90']:.0f}  p99 {st['p99']:.0f}  max {st['max']}"
        )
        for line in text_histogram(st["histogram"]):
            print("  " + line)
        if name in mix["per_stream"]:
            own = mix["per_stream"][name]
            print(
                f"  at the mixture's seq_len {mix['seq_len']}: {own['docs_longer']:.2%} of its "
                f"documents are longer, {own['tokens_cut']:.2%} of its tokens lie past the "
                "first seq_len of their document"
            )
    _print_mixture(mix, cfg.packing.overflow)
    return 0


def _print_mixture(mix: dict, overflow: str) -> None:
    if mix["seq_len"] is None:
        print("mixture: no document sampled, no recommendation")
        return
    weights = ", ".join(
        f"{n} {w:.3f} of tokens, {mix['doc_share'][n]:.1%} of documents"
        for n, w in mix["weights"].items()
    )
    fate = {"split": "split across rows", "truncate": "cut off (truncate)",
            "drop": "dropped (drop)"}[overflow]  # fmt: skip
    print(f"mixture at the configured weights ({weights}):")
    print("  seq_len   documents longer   tokens past the first seq_len of their document")
    for L, c in mix["curve"].items():
        mark = "   <- recommended" if mix["seq_len"] == L else ""
        print(f"  {L:>7}   {c['docs_longer']:>16.2%}   {c['tokens_cut']:>7.2%}{mark}")
    print(
        f"recommended seq_len: {mix['seq_len']} for the whole mixture: the shortest power of two "
        f"whose rows hold {mix['fit']:.0%} of the mixture's documents whole, counting documents "
        f"as the configured weights take them (a longer document is {fate}, per "
        f"packing.overflow: {overflow}). A shorter row costs the shares above; a longer one "
        "costs attention per token, and packing fills it with short documents either way."
    )
