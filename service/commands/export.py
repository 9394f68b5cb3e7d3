"""`tokenmill export`: the config's global steps written to files, with a progress line and a
summary of what was made and what was not."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.read.resolve import load_config
from service.commands.resume import documents_to_leave_out, read_state

if TYPE_CHECKING:
    from pipeline.read.reading import Executor
    from pipeline.state.summary import ExportReport, RunSummary


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
    resume = read_state(args.resume)
    leave_out = documents_to_leave_out(args, cfg, resume, Path(args.out))
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
