"""The `tokenmill` command line: check, stats and export a config's data, serve it to trainer
ranks, and watch or stop a running service. Also `python -m service`, for `ray job submit`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import ConfigError
from pipeline.read.resolve import load_config

if TYPE_CHECKING:
    from pipeline.read.reading import Executor
    from pipeline.state.summary import ExportReport, RunSummary

ADDRESS_HELP = (
    "Ray cluster to join (`auto`: the one Ray finds; None: a new, private local Ray, never "
    "a cluster that happens to run here)"
)


def _progress(every_s: float = 5.0):
    last = [0.0]

    def report(steps: int, tokens: int, elapsed: float) -> None:
        if elapsed - last[0] >= every_s:
            last[0] = elapsed
            rate = tokens / elapsed if elapsed else 0.0
            print(
                f"  step {steps:>7}  {tokens:>12,} tokens  {rate:>10,.0f} tok/s  {elapsed:6.1f}s",
                file=sys.stderr,
            )

    return report


def _print_summary(s: RunSummary, x: ExportReport) -> None:
    """The export's figures. A resumed export's state carries the run's counts since step 0:
    every count is then shown twice, labelled, "this run" (what this export wrote) and "since
    step 0" (the run so far); rates and times are this run's."""
    run = x.this_run
    if x.resumed_from_step is None:
        print(f"steps            {run.steps}  (rows {run.rows}, seq_len {s.seq_len})")
        print(f"tokens           {run.real_tokens:,}")
    else:
        first, last = x.resumed_from_step, x.resumed_from_step + run.steps - 1
        span = f"steps {first}-{last}" if run.steps else "no step"
        print(
            f"resumed          at step {first}: 'this run' is this export, 'since step 0' the run"
        )
        print(
            f"steps            {run.steps} this run ({span}), {s.steps} since step 0  "
            f"(rows {run.rows} this run, {s.rows} since step 0, seq_len {s.seq_len})"
        )
        print(f"tokens           {run.real_tokens:,} this run, {s.real_tokens:,} since step 0")
    ttfs = x.time_to_first_step_s
    print(
        f"wall             {x.wall_s:.1f}s from process start "
        f"(start-up {x.startup_s:.1f}s, first step at "
        + ("-" if ttfs is None else f"{ttfs:.1f}s")
        + ")"
    )
    print(
        f"tokens/s         {x.tokens_per_s:,.0f} end to end; "
        f"{x.steady_tokens_per_s:,.0f} steady (feed start to last step)"
    )
    packing = f"{100 * run.packing_efficiency:.2f}% real tokens"
    if x.resumed_from_step is not None:
        packing += f" this run, {100 * s.packing_efficiency:.2f}% since step 0"
    print(f"packing          {packing}")
    ph = x.phases
    marks = {"ray up": ph.ray_connected, "feed started": ph.feed_started,
             "first block (head start)": ph.first_block_in_process,
             "first block from workers": ph.first_block_from_executor}  # fmt: skip
    reached = [f"{label} {t:.1f}s" for label, t in marks.items() if t is not None]
    if reached:
        here, there = ph.tokens_made_here, ph.tokens_made_by_executor
        share = f"; {here / (here + there):.0%} of tokens made here" if here + there else ""
        print(f"phases           {', '.join(reached)}; writing took {ph.writing_s:.1f}s{share}")
    used = {k: v for k, v in s.tokenizer_backend.items() if v}
    if used:
        total = sum(used.values())
        print(
            "tokenizer        "
            + ", ".join(
                f"{k} {v / total:.1%}" for k, v in sorted(used.items(), key=lambda kv: -kv[1])
            )
            + " of tokens read"
        )
    resumed = x.resumed_from_step is not None
    if resumed:
        print("per stream: tokens, docs and skipped this run; 'since 0' and the rest: the run")
    since = f"{'since 0':>14}" if resumed else ""
    print(
        f"{'stream':<12}{'target':>8}{'realized':>10}{'tokens':>14}{since}{'docs':>9}"
        f"{'skipped':>9}{'split':>7}{'trunc':>7}{'drop':>6}"
    )
    for name, st in s.streams.items():
        mine = run.streams[name]
        since = f"{st.tokens:>14,}" if resumed else ""
        print(
            f"{name:<12}{st.target_share:>8.3f}{st.realized_share:>10.3f}{mine['tokens']:>14,}"
            f"{since}{mine['docs']:>9,}{mine['skipped']:>9,}{st.split:>7,}{st.truncated:>7,}"
            f"{st.dropped:>6,}"
        )
    for line in s.exhausted:
        print(f"note: {line}")


def _executor(args, ready) -> Executor | None:
    """Where an export tokenizes: in this process (`--local`), on a warm pool of actors
    (`--pool N`, and by default when joining a running cluster, sized to its CPUs: a pool
    there outlives this export, so the next one finds it warm), or on Ray Data tasks (None)."""
    from client.cluster import requested_address
    from pipeline.read.reading import iter_blocks_local

    if args.local:
        return iter_blocks_local
    if args.pool or (args.pool is None and requested_address(args.address)):
        from pipeline.read.pool import pool_executor

        return pool_executor(args.pool or None, args.pool_idle_s, ready)
    return None


def _quiet_thread_init() -> None:
    """Drop Ray's "SIGTERM handler is not set because current thread is not the main thread".

    `ray.init` says so whenever it runs off the main thread, as the export's background
    connect does (client/cluster.py `connect_in_background`). Nothing is lost: without Ray's
    handler SIGTERM ends the export at once, as it would any process, and an embedded Ray's
    processes go with it (they die with their parent, see `entry`)."""
    import logging

    logging.getLogger("ray._private.worker").addFilter(
        lambda record: "SIGTERM handler is not set" not in record.getMessage()
    )


def cmd_export(args) -> int:
    from service.export import run_export

    ready = None
    if not args.local:  # Ray starts (or is joined) while the config loads and the feed starts
        from client.cluster import connect_in_background

        _quiet_thread_init()
        ready = connect_in_background(args.address)
    cfg = load_config(args.config)
    resume = _read_state(args.resume)
    leave_out = _leave_out(args, cfg, resume, Path(args.out))
    executor = _executor(args, ready)
    summary = run_export(
        cfg, args.out, steps=args.steps, world_size=args.world_size, fmt=args.format,
        executor=executor, progress=_progress(), state_every=args.state_every or 0,
        resume=resume, allow_config_change=args.allow_config_change, layout=args.layout,
        ray_ready=ready, leave_out=leave_out,
    )  # fmt: skip
    report = summary.export
    assert report is not None  # run_export sets it
    if ready is not None and _needs_ray(ready, args.address, report):
        ready.result()  # a connect that failed after a head start still fails the run
    _print_summary(summary, report)
    out = Path(args.out)  # "out/" and "out" alike
    print(f"wrote {out}/ (summary.json, rejects.jsonl: {report.rejects_written} skipped records)")
    empty = undelivered_streams(summary, str(out / "rejects.jsonl"))
    for name, why in empty.items():
        print(f"error: stream {name!r} delivered nothing: {why}", file=sys.stderr)
    if not report.steps_written:  # every record rejected or dropped, or no data at all
        print(
            f"error: the export delivered nothing: {report.rejects_written} skipped "
            f"records (see {out / 'rejects.jsonl'}), 0 steps",
            file=sys.stderr,
        )
        return 1
    return 1 if empty else 0


def undelivered_streams(summary: RunSummary, rejects: str = "rejects.jsonl") -> dict[str, str]:
    """Streams that read records but delivered no document: every one rejected or dropped.

    The run may still have written steps from its other streams (`on_exhausted:
    renormalize`), but its mixture is not the configured one, so it is a failure, never a
    silent success. A stream not yet reached when `--steps` ran out read nothing and is fine.
    """
    out = {}
    for name, st in summary.streams.items():
        if st.docs:
            continue
        if st.skipped and not st.docs_read:
            out[name] = f"all {st.skipped} record(s) read were rejected (see {rejects})"
        elif st.dropped:
            out[name] = (
                f"all {st.dropped} document(s) were dropped (longer than seq_len with "
                "packing.overflow: drop)"
            )
    return out


def _needs_ray(ready, address: str | None, report: ExportReport) -> bool:
    """Whether the export must wait for its Ray connect before it may exit.

    A cluster the user named is always waited for: a wrong address or token is an error even
    when the head start made every token. A private embedded Ray that no unit ran on is not:
    the export is complete and correct, and waiting would only spend Ray's 3-9 s start-up on
    nothing (small exports). Its processes end with this one."""
    from client.cluster import requested_address

    used = report.phases.tokens_made_by_executor > 0
    return used or ready.done() or requested_address(address) is not None


def _leave_out(args, cfg, resume: dict | None, out: Path | None = None):
    """The documents `--skip-steps` and `--skip-docs` name (a `feed.LeaveOut`), or None.

    The steps' documents come from the export's directory (`out`) where it still holds
    those steps, else are recomputed from the `--resume` state (at or before them)."""
    if not (args.skip_steps or args.skip_docs):
        return None
    from pipeline.inspect.provenance import leave_out, read_documents, steps_documents

    docs: list[dict] = []
    why = []
    try:
        if args.skip_steps:
            steps = parse_steps(args.skip_steps)
            where = out if out is not None and out.is_dir() else None
            if where is None and resume is None:
                raise ValueError("needs the export's directory holding those steps, or --resume")
            docs += steps_documents(cfg, steps, out=where, state=resume)
            why.append(f"--skip-steps {args.skip_steps}")
        if args.skip_docs:
            docs += read_documents(cfg, args.skip_docs)
            why.append(f"--skip-docs {args.skip_docs}")
    except (OSError, ValueError) as e:
        flag = "--skip-docs" if why else ("--skip-steps" if args.skip_steps else "--skip-docs")
        raise ConfigError(f"{flag}: {e}") from None
    chosen = leave_out(docs, "; ".join(why))
    count = sum(len(v) for v in chosen.docs.values())
    print(f"tokenmill: leaving out {count} document(s) from step "
          f"{resume['step'] if resume else 0} on ({chosen.why})", file=sys.stderr)  # fmt: skip
    return chosen


def _read_state(path: str | None, flag: str = "--resume") -> dict | None:
    if not path:
        return None
    from pipeline.state.resume import StateError, load_state

    try:
        return load_state(path)
    except StateError as e:  # not JSON, or JSON that is not an object (`null` is no state)
        raise ConfigError(f"{flag} {e}") from None


def _service_name(text: str) -> str:
    """argparse's check of `--name` (one rule for every service name: wire/protocol.py)."""
    from wire.protocol import check_service_name

    try:
        return check_service_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_serve(args) -> int:
    from service.serve import run_serve

    cfg = load_config(args.config)
    resume = _read_state(args.resume)
    return run_serve(
        cfg, resume=resume, address=args.address, host=args.host,
        port=args.port, name=args.name, allow_config_change=args.allow_config_change,
        leave_out=_leave_out(args, cfg, resume),
    )  # fmt: skip


def parse_steps(text: str) -> list[int]:
    """`12`, `41230-41240` or `3,7,9-11`: the steps, ascending, each once."""
    from pipeline.inspect.provenance import parse_steps as parse

    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"--step {e}") from None


def cmd_trace(args) -> int:
    from pipeline.inspect.provenance import RankOutsideWorld, trace

    cfg = load_config(args.config)
    state = _read_state(args.state, "--state") if args.state else None
    if args.rank is not None and args.rank < 0:
        raise ConfigError(f"--rank must be >= 0, got {args.rank}")
    if args.rank is not None and args.world_size and args.rank >= args.world_size:
        raise ConfigError(f"--rank {args.rank} is outside --world-size {args.world_size}")
    try:
        segs = trace(
            cfg, parse_steps(args.step), out=Path(args.out) if args.out else None, state=state,
            rank=args.rank, world_size=args.world_size, text=args.text,
        )  # fmt: skip
    except RankOutsideWorld as e:
        raise ConfigError(f"--rank: {e}") from None
    if args.json:
        print(json.dumps(segs, indent=1))
        return 0
    for seg in segs:
        a, b = seg["tokens"]
        print(f"step {seg['step']:>7}  row {seg['row']:>4}  rank {seg['rank']:>3}  "
              f"{seg['stream']:<12} {seg['source']}, record {seg['record']}  "
              f"tokens {a}-{b} of the document (row {seg['row_span'][0]}-{seg['row_span'][1]})")  # fmt: skip
        if args.text:
            text = seg["text"] if len(seg["text"]) <= 400 else seg["text"][:400] + " [...]"
            print("    " + text.replace("\n", "\n    "))
    print(f"{len(segs)} segments, {len({(s['stream'], s['doc_id']) for s in segs})} documents",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_stop(args) -> int:
    from service.serve import run_stop

    return run_stop(args.name, args.address, timeout_s=args.timeout, now=args.now)


def cmd_status(args) -> int:
    from service.serve import run_status

    return run_status(args.name, args.address, as_json=args.json, wait_s=args.wait)


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


def cmd_demo(args) -> int:
    from service.demo import run_demo

    summary = run_demo(steps=args.steps, out=args.out, address=args.address, policy=args.policy)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0


def cmd_corpus(args) -> int:
    from service.demo_corpus import build_demo_corpus

    out = build_demo_corpus(args.out)
    print(f"demo corpus in {out}: code.jsonl (pretrain), chat.jsonl (chat)")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every optional flag shows its default: argparse appends "(default: X)" to its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description=__doc__, formatter_class=_Help)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_Help)

    config_help = (
        "the run's YAML config (a relative path in it: the working directory's if it exists "
        "there, else the config directory's)"
    )
    v = command("serve", "run the service: batch server + control API")
    v.add_argument("--config", required=True, help=config_help)
    v.add_argument(
        "--resume", default=None, help="start from a state (GET /v1/state, state-N.json)"
    )
    v.add_argument("--address", default=None, help=ADDRESS_HELP)
    v.add_argument("--host", default=None, help="API bind address (None: the config's, 127.0.0.1)")
    v.add_argument("--port", type=int, default=None, help="API port (None: the config's, 8000)")
    v.add_argument("--name", default="tokenmill", type=_service_name,
                   help="the service (actor) name trainers connect to")  # fmt: skip
    v.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a state written by a different config (recorded in the history)",
    )
    v.add_argument(
        "--skip-steps",
        default=None,
        metavar="STEPS",
        help="leave out the documents these steps drew (41230-41240, or 3,7,9-11): recomputed from --resume, "
        "from the resume step on, in every epoch; listed in the summary and the state",
    )
    v.add_argument(
        "--skip-docs",
        default=None,
        metavar="FILE",
        help="leave out the documents a file names (JSON or JSON lines of {stream, doc_id} "
        "or {stream, source, record}: `tokenmill trace --json` output works)",
    )
    v.set_defaults(func=cmd_serve)

    for verb, func, doc in (
        ("stop", cmd_stop, "stop a running service (its serve drains and exits)"),
        ("status", cmd_status, "print a running service's status"),
    ):
        x = command(verb, doc)
        x.add_argument("--name", default="tokenmill", type=_service_name, help="the service name")
        x.add_argument(
            "--address",
            default=None,
            help="its Ray cluster (None: from the service's record on this machine, else "
            "RAY_ADDRESS, else the one cluster running here)",
        )
        if verb == "status":
            x.add_argument("--json", action="store_true", help="status and metrics as JSON")
            x.add_argument("--wait", type=float, default=30.0,
                           help="seconds to wait for a service that is starting (its record "
                           "claimed, its Ray or actor not up yet); 0: answer at once (30)")  # fmt: skip
        else:
            x.add_argument("--now", action="store_true",
                           help="end every rank at once, without the steps already made")  # fmt: skip
            x.add_argument("--timeout", type=float, default=600.0,
                           help="seconds to wait for the drain before killing serve (600)")  # fmt: skip
        x.set_defaults(func=func)

    e = command("export", "write the served batch sequence to files")
    e.add_argument("--config", required=True, help=config_help)
    e.add_argument("--out", required=True, help="the directory to write (created if missing)")
    e.add_argument("--steps", type=int, default=None, help="global steps to write (None: all)")
    e.add_argument("--world-size", type=int, default=1, help="ranks: one file per rank and step")
    e.add_argument(
        "--format",
        choices=["parquet", "arrow", "mds"],
        default="parquet",
        help="step files: parquet, arrow (IPC), or one MDS dataset",
    )
    e.add_argument(
        "--layout",
        choices=["compact", "full"],
        default="compact",
        help="compact: no columns that seq_lens and input_ids determine (position_ids, "
        "segment_ids, and labels unless a stream masks tokens), expanded on read; "
        "full: every column as served",
    )
    e.add_argument("--address", default=None, help=ADDRESS_HELP)
    e.add_argument(
        "--state-every",
        type=int,
        default=0,
        help="write DIR/state-N.json every K steps (0: only at the end)",
    )
    e.add_argument("--resume", default=None, help="continue from a state-N.json")
    e.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a state written by a different config (logged)",
    )
    e.add_argument(
        "--skip-steps",
        default=None,
        metavar="STEPS",
        help="leave out the documents these steps drew (41230-41240, or 3,7,9-11): read from --out where it holds them, else recomputed from --resume, "
        "from the resume step on, in every epoch; listed in the summary and the state",
    )
    e.add_argument(
        "--skip-docs",
        default=None,
        metavar="FILE",
        help="leave out the documents a file names (JSON or JSON lines of {stream, doc_id} "
        "or {stream, source, record}: `tokenmill trace --json` output works)",
    )
    e.add_argument("--local", action="store_true", help="run in-process without Ray (debugging)")
    e.add_argument(
        "--pool",
        type=int,
        default=None,
        metavar="N",
        help="tokenize on a warm pool of N named actors that stay up between exports, instead "
        "of Ray Data tasks in fresh workers (0: Ray Data). Default: a pool of the cluster's "
        "CPUs when joining a running cluster (--address, RAY_ADDRESS): the first export "
        "creates it, the next find it warm; none with a private local Ray",
    )
    e.add_argument(
        "--pool-idle-s",
        type=float,
        default=300.0,
        help="a pool actor exits (and frees its CPU) after this many seconds without work",
    )
    e.set_defaults(func=cmd_export)

    c = command("check", "validate the config, load the tokenizer and scan every record")
    c.add_argument("--config", required=True, help=config_help)
    c.add_argument(
        "--show", type=int, default=20, help="bad records listed per stream (all are counted)"
    )
    c.set_defaults(func=cmd_check)

    s = command("stats", "token lengths per stream, and one seq_len for the whole mixture")
    s.add_argument("--config", required=True, help=config_help)
    s.add_argument("--docs", type=int, default=2000, help="documents sampled per stream")
    s.add_argument("--json", default=None, help="also write the figures to this file")
    s.add_argument(
        "--fit",
        type=float,
        default=0.99,
        help="the share of the mixture's documents (at the configured weights) that the "
        "recommended seq_len holds whole",
    )
    s.set_defaults(func=cmd_stats)

    t = command(
        "trace",
        "which documents fed a step: each segment's stream, source file, record (0-based) and "
        "token range within its document",
    )
    t.add_argument("--config", required=True, help=config_help)
    t.add_argument("--step", required=True, help="a step, a range (41230-41240) or a list")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--out", default=None, help="an export's directory (Parquet or Arrow)")
    src.add_argument(
        "--state", default=None,
        help="a state at or before the step (state-N.json, GET /v1/state): the feed is rebuilt "
        "there and run forward to the step, in this process",
    )  # fmt: skip
    t.add_argument("--rank", type=int, default=None, help="only this rank's rows")
    t.add_argument(
        "--world-size", type=int, default=None,
        help="ranks the rows are split among (None: the export's, else 1)",
    )  # fmt: skip
    t.add_argument("--text", action="store_true", help="also each segment's decoded text")
    t.add_argument("--json", action="store_true", help="one JSON list of segments")
    t.set_defaults(func=cmd_trace)

    k = command("corpus", "write the demo corpus (from the standard library) to a directory")
    k.add_argument("--out", default="data/demo", help="the directory to write")
    k.set_defaults(func=cmd_corpus)

    command("bench", "the benchmark suite (options: --quick, --json PATH; see --help)")

    d = command("demo", "the main job on the embedded default")
    d.add_argument("--steps", type=int, default=60, help="training steps")
    d.add_argument("--json", default=None, help="also write the demo's summary to this file")
    d.add_argument("--out", default=None, help="where to export (None: a temporary directory)")
    d.add_argument("--address", default=None, help=ADDRESS_HELP)
    d.add_argument("--policy", action="store_true",
                   help="turn the mixing policy on (weights that follow each stream's loss)")  # fmt: skip
    d.set_defaults(func=cmd_demo)
    return p  # fmt: skip


def run_bench(argv: list[str]) -> int:
    """`tokenmill bench [e2e] ...`: `python -m bench` in a process of its own.

    The benchmarks (bench/) are a part of the source tree, not of the product: nothing here
    imports them. They run with the checkout that holds this package on the path, from the
    working directory, so relative paths in their options mean what the user typed."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "__main__.py").is_file():
        print(
            f"error: `tokenmill bench` runs the benchmarks of a source checkout (bench/), and "
            f"there is none beside this installation ({root}): run `./dev bench` in a clone "
            "of the repository",
            file=sys.stderr,
        )
        return 2
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    try:
        return subprocess.call(
            [sys.executable, "-m", "bench", *argv], env=os.environ | {"PYTHONPATH": path}
        )
    except KeyboardInterrupt:  # the benchmark got the Ctrl-C too, and has stopped
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmarks parse their own options
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    for flag in ("steps", "world_size", "state_every"):
        value = getattr(args, flag, None)
        if value is not None and value < (0 if flag == "state_every" else 1):
            need = ">= 0" if flag == "state_every" else ">= 1"
            print(f"error: --{flag.replace('_', '-')} must be {need}, got {value}", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a clear message, then the exit code; tracebacks with TOKENMILL_DEBUG
        import os

        if os.environ.get("TOKENMILL_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", []):
            print(f"  {note}", file=sys.stderr)
        return 1
    finally:
        if args.command not in ("check", "status"):
            print(f"({time.monotonic() - t0:.1f}s)", file=sys.stderr)


def entry() -> None:
    """The `tokenmill` command: `main`, then, after an export, a quick exit.

    Once an export's files are written and closed, the rest of a normal exit is waiting:
    `ray.shutdown()` took 1.4 s here and the interpreter's teardown another 1.0 s (8% of a
    warm ~100 MB export). So the process ends at once instead. An embedded Ray goes with it:
    Ray starts its processes with PR_SET_PDEATHSIG, so the kernel ends them when this
    process does (tests/test_exports.py checks that none is left). A cluster we only joined
    sees its driver gone, as it does after Ctrl-C, and ends the job's workers."""
    code = main()
    if sys.argv[1:2] == ["export"]:
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
