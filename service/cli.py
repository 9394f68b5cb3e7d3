"""The `tokenmill` command line (SPEC §3.1). Also `python -m service` for `ray job submit`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.config import ConfigError, load_config

ADDRESS_HELP = (
    "Ray cluster to join (`auto`: the one Ray finds; default: a new, private local Ray, never "
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


def _print_summary(s: dict) -> None:
    print(f"steps            {s['steps_written']}  (rows {s['rows']}, seq_len {s['seq_len']})")
    print(f"tokens           {s['real_tokens']:,}")
    ttfs = s["time_to_first_step_s"]
    print(
        f"wall             {s['wall_s']:.1f}s from process start "
        f"(start-up {s['startup_s']:.1f}s, first step at "
        + ("-" if ttfs is None else f"{ttfs:.1f}s")
        + ")"
    )
    print(
        f"tokens/s         {s['tokens_per_s']:,.0f} end to end; "
        f"{s['steady_tokens_per_s']:,.0f} steady (first block in to last step)"
    )
    print(f"packing          {100 * s['packing_efficiency']:.2f}% real tokens")
    names = {"ray_connected": "ray up", "feed_started": "feed started",
             "first_block_in_process": "first block (head start)",
             "first_block_from_executor": "first block from workers"}  # fmt: skip
    ph = s.get("phases", {})
    marks = [f"{label} {ph[k]:.1f}s" for k, label in names.items() if ph.get(k) is not None]
    if marks:
        here, there = ph.get("tokens_made_here", 0), ph.get("tokens_made_by_executor", 0)
        share = f"; {here / (here + there):.0%} of tokens made here" if here + there else ""
        print(f"phases           {', '.join(marks)}; writing took {ph['writing_s']:.1f}s{share}")
    used = {k: v for k, v in s.get("tokenizer_backend", {}).items() if v}
    if used:
        total = sum(used.values())
        print(
            "tokenizer        "
            + ", ".join(
                f"{k} {v / total:.1%}" for k, v in sorted(used.items(), key=lambda kv: -kv[1])
            )
            + " of tokens read"
        )
    print(
        f"{'stream':<12}{'target':>8}{'realized':>10}{'tokens':>14}{'docs':>9}{'skipped':>9}{'split':>7}{'trunc':>7}{'drop':>6}"
    )
    for name, st in s["streams"].items():
        print(
            f"{name:<12}{st['target_share']:>8.3f}{st['realized_share']:>10.3f}{st['tokens']:>14,}"
            f"{st['docs']:>9,}{st['skipped']:>9,}{st['split']:>7,}{st['truncated']:>7,}{st['dropped']:>6,}"
        )
    for line in s.get("exhausted", []):
        print(f"note: {line}")


def cmd_export(args) -> int:
    from service.export import run_export

    ready = None
    if not args.local:  # Ray starts (or is joined) while the config loads and the feed starts
        from service.cluster import connect_in_background

        ready = connect_in_background(args.address)
    cfg = load_config(args.config)
    resume = _read_state(args.resume)
    summary = run_export(
        cfg, args.out, steps=args.steps, world_size=args.world_size, fmt=args.format,
        local=args.local, progress=_progress(), state_every=args.state_every or 0,
        resume=resume, allow_config_change=args.allow_config_change, layout=args.layout,
        ray_ready=ready,
    )  # fmt: skip
    if ready is not None:
        ready.result()  # a connect that failed after a head start still fails the run
    _print_summary(summary)
    print(
        f"wrote {args.out}/ (summary.json, rejects.jsonl: {summary['rejects_written']} skipped records)"
    )
    if not summary["steps_written"]:  # every record rejected or dropped, or no data at all
        print(
            f"error: the export delivered nothing: {summary['rejects_written']} skipped "
            f"records (see {args.out}/rejects.jsonl), 0 steps",
            file=sys.stderr,
        )
        return 1
    return 0


def _read_state(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {path}: cannot read the state: {e}") from None


def cmd_serve(args) -> int:
    from service.serve import run_serve

    cfg = load_config(args.config)
    return run_serve(
        cfg, resume=_read_state(args.resume), address=args.address, host=args.host,
        port=args.port, name=args.name, allow_config_change=args.allow_config_change,
    )  # fmt: skip


def cmd_stop(args) -> int:
    from service.serve import run_stop

    return run_stop(args.name, args.address)


def cmd_status(args) -> int:
    from service.serve import run_status

    return run_status(args.name, args.address, as_json=args.json)


def cmd_check(args) -> int:
    from pipeline.stats import scan

    cfg = load_config(args.config)
    print(f"config ok: {len(cfg.streams)} stream(s), hash {cfg.config_hash()}")
    for name, s in cfg.streams.items():
        print(f"  {name}: {s.kind}, {s.format}, {len(s.paths)} path(s), weight {s.weight}")
    bad = 0
    for rej in scan(cfg):
        bad += 1
        where = rej.file + ("" if rej.record is None else f":{rej.record}")
        print(f"BAD {rej.stream}: {where}: {rej.reason}")
    if bad:
        print(f"{bad} bad record(s)", file=sys.stderr)
        return 1
    print("all records ok")
    return 0


def cmd_stats(args) -> int:
    from pipeline.stats import length_stats, text_histogram

    cfg = load_config(args.config)
    stats = length_stats(cfg, docs=args.docs)
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=2) + "\n")
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
        print(f"  recommended seq_len: {st['recommended_seq_len']} (holds the p99 document whole)")
    return 0


def cmd_demo(args) -> int:
    from service.demo import run_demo

    summary = run_demo(steps=args.steps, out=args.out, address=args.address)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0


def cmd_corpus(args) -> int:
    from service.demo_corpus import build_demo_corpus

    out = build_demo_corpus(args.out)
    print(f"demo corpus in {out}: code.jsonl (pretrain), chat.jsonl (chat)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("serve", help="run the service: batch server + control API")
    v.add_argument("--config", required=True)
    v.add_argument(
        "--resume", default=None, help="start from a state (GET /v1/state, state-N.json)"
    )
    v.add_argument("--address", default=None, help=ADDRESS_HELP)
    v.add_argument("--host", default=None, help="API bind address (default: config, 127.0.0.1)")
    v.add_argument("--port", type=int, default=None)
    v.add_argument(
        "--name", default="tokenmill", help="the service (actor) name trainers connect to"
    )
    v.add_argument("--allow-config-change", action="store_true")
    v.set_defaults(func=cmd_serve)

    for verb, func, doc in (("stop", cmd_stop, "stop a running service (its serve drains and exits)"),
                            ("status", cmd_status, "print a running service's status")):  # fmt: skip
        x = sub.add_parser(verb, help=doc)
        x.add_argument("--name", default="tokenmill", help="the service name (default tokenmill)")
        x.add_argument(
            "--address", default=None,
            help="its Ray cluster (default: from the service's record on this machine, else "
            "RAY_ADDRESS, else the one cluster running here)",
        )  # fmt: skip
        if verb == "status":
            x.add_argument("--json", action="store_true", help="status and metrics as JSON")
        x.set_defaults(func=func)

    e = sub.add_parser("export", help="write the served batch sequence to files")
    e.add_argument("--config", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--steps", type=int, default=None, help="global steps to write (default: all)")
    e.add_argument("--world-size", type=int, default=1)
    e.add_argument(
        "--format",
        choices=["parquet", "arrow", "mds"],
        default="parquet",
        help="step files: parquet, arrow (IPC), or one MDS dataset (default parquet)",
    )
    e.add_argument(
        "--layout",
        choices=["compact", "full"],
        default="compact",
        help="compact: no columns that seq_lens and input_ids determine (position_ids, "
        "segment_ids, and labels unless a stream masks tokens), expanded on read; "
        "full: every column as served (default compact)",
    )
    e.add_argument("--address", default=None, help=ADDRESS_HELP)
    e.add_argument(
        "--state-every", type=int, default=0, help="write DIR/state-N.json every K steps"
    )
    e.add_argument("--resume", default=None, help="continue from a state-N.json")
    e.add_argument("--allow-config-change", action="store_true",
                   help="resume a state written by a different config (logged)")  # fmt: skip
    e.add_argument("--local", action="store_true", help="run in-process without Ray (debugging)")
    e.set_defaults(func=cmd_export)

    c = sub.add_parser("check", help="validate the config and scan every record")
    c.add_argument("--config", required=True)
    c.set_defaults(func=cmd_check)

    s = sub.add_parser("stats", help="per-stream token-length distribution")
    s.add_argument("--config", required=True)
    s.add_argument("--docs", type=int, default=2000)
    s.add_argument("--json", default=None)
    s.set_defaults(func=cmd_stats)

    k = sub.add_parser(
        "corpus", help="write the demo corpus (from the standard library) to a directory"
    )
    k.add_argument("--out", default="data/demo")
    k.set_defaults(func=cmd_corpus)

    sub.add_parser("bench", help="the benchmark suite (options: --quick, --json PATH; see --help)")

    d = sub.add_parser("demo", help="the main job on the embedded default")
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--json", default=None)
    d.add_argument("--out", default=None, help="where to export (default: a temporary directory)")
    d.add_argument("--address", default=None, help=ADDRESS_HELP)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "e2e"]:  # against the hand-written script, cold and warm
        from bench.e2e import main as e2e_main

        return e2e_main(argv[2:])
    if argv[:1] == ["bench"]:  # the suite parses its own options
        from bench.suite import main as bench_main

        return bench_main(argv[1:])
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
