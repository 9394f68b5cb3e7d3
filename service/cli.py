"""The `tokenmill` command line: check, stats and export a config's data, serve it to trainer
ranks, and watch or stop a running service. Also `python -m service`, for `ray job submit`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.config import ConfigError
from service.commands.checks import cmd_check, cmd_stats
from service.commands.export import cmd_export
from service.commands.running import (
    cmd_corpus,
    cmd_demo,
    cmd_serve,
    cmd_status,
    cmd_stop,
    cmd_trace,
    service_name,
)

ADDRESS_HELP = (
    "Ray cluster to join (`auto`: the one Ray finds; None: a new, private local Ray, never "
    "a cluster that happens to run here)"
)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every optional flag shows its default: argparse appends "(default: X)" to its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


CONFIG_HELP = (
    "the run's YAML config (a relative path in it: the working directory's if it exists "
    "there, else the config directory's)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description=__doc__, formatter_class=_Help)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, func=None) -> argparse.ArgumentParser:
        x = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        if func is not None:
            x.set_defaults(func=func)
        return x

    _serve(command("serve", "run the service: batch server + control API", cmd_serve))
    _stop_or_status(command("stop", "stop a running service (its serve drains and exits)",
                            cmd_stop), "stop")  # fmt: skip
    _stop_or_status(command("status", "print a running service's status", cmd_status), "status")
    _export(command("export", "write the served batch sequence to files", cmd_export))
    _check(command("check", "validate the config, load the tokenizer and scan every record",
                   cmd_check))  # fmt: skip
    _stats(command("stats", "token lengths per stream, and one seq_len for the whole mixture",
                   cmd_stats))  # fmt: skip
    _trace(command("trace", "which documents fed a step: each segment's stream, source file, "
                   "record (0-based) and token range within its document", cmd_trace))  # fmt: skip
    _corpus(command("corpus", "write the demo corpus (from the standard library) to a directory",
                    cmd_corpus))  # fmt: skip
    command("bench", "the benchmark suite (options: --quick, --json PATH; see --help)")
    _demo(command("demo", "the main job on the embedded default", cmd_demo))
    return p


def _serve(p: argparse.ArgumentParser) -> None:
    """`serve`'s arguments."""
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument(
        "--resume", default=None, help="start from a state (GET /v1/state, state-N.json)"
    )
    p.add_argument("--address", default=None, help=ADDRESS_HELP)
    p.add_argument("--host", default=None, help="API bind address (None: the config's, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="API port (None: the config's, 8000)")
    p.add_argument("--name", default="tokenmill", type=service_name,
                   help="the service (actor) name trainers connect to")  # fmt: skip
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a state written by a different config (recorded in the history)",
    )
    p.add_argument(
        "--skip-steps",
        default=None,
        metavar="STEPS",
        help="leave out the documents these steps drew (41230-41240, or 3,7,9-11): recomputed from --resume, "
        "from the resume step on, in every epoch; listed in the summary and the state",
    )
    p.add_argument(
        "--skip-docs",
        default=None,
        metavar="FILE",
        help="leave out the documents a file names (JSON or JSON lines of {stream, doc_id} "
        "or {stream, source, record}: `tokenmill trace --json` output works)",
    )


def _stop_or_status(p: argparse.ArgumentParser, verb: str) -> None:
    """`stop` and `status`: which service, where; then each one's own."""
    p.add_argument("--name", default="tokenmill", type=service_name, help="the service name")
    p.add_argument(
        "--address",
        default=None,
        help="its Ray cluster (None: from the service's record on this machine, else "
        "RAY_ADDRESS, else the one cluster running here)",
    )
    if verb == "status":
        p.add_argument("--json", action="store_true", help="status and metrics as JSON")
        p.add_argument("--wait", type=float, default=30.0,
                       help="seconds to wait for a service that is starting (its record "
                       "claimed, its Ray or actor not up yet); 0: answer at once (30)")  # fmt: skip
    else:
        p.add_argument("--now", action="store_true",
                       help="end every rank at once, without the steps already made")  # fmt: skip
        p.add_argument("--timeout", type=float, default=600.0,
                       help="seconds to wait for the drain before killing serve (600)")  # fmt: skip


def _export(p: argparse.ArgumentParser) -> None:
    """`export`'s arguments."""
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("--out", required=True, help="the directory to write (created if missing)")
    p.add_argument("--steps", type=int, default=None, help="global steps to write (None: all)")
    p.add_argument("--world-size", type=int, default=1, help="ranks: one file per rank and step")
    p.add_argument(
        "--format",
        choices=["parquet", "arrow", "mds"],
        default="parquet",
        help="step files: parquet, arrow (IPC), or one MDS dataset",
    )
    p.add_argument(
        "--layout",
        choices=["compact", "full"],
        default="compact",
        help="compact: no columns that seq_lens and input_ids determine (position_ids, "
        "segment_ids, and labels unless a stream masks tokens), expanded on read; "
        "full: every column as served",
    )
    p.add_argument("--address", default=None, help=ADDRESS_HELP)
    p.add_argument(
        "--state-every",
        type=int,
        default=0,
        help="write DIR/state-N.json every K steps (0: only at the end)",
    )
    p.add_argument("--resume", default=None, help="continue from a state-N.json")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a state written by a different config (logged)",
    )
    p.add_argument(
        "--skip-steps",
        default=None,
        metavar="STEPS",
        help="leave out the documents these steps drew (41230-41240, or 3,7,9-11): read from --out where it holds them, else recomputed from --resume, "
        "from the resume step on, in every epoch; listed in the summary and the state",
    )
    p.add_argument(
        "--skip-docs",
        default=None,
        metavar="FILE",
        help="leave out the documents a file names (JSON or JSON lines of {stream, doc_id} "
        "or {stream, source, record}: `tokenmill trace --json` output works)",
    )
    p.add_argument("--local", action="store_true", help="run in-process without Ray (debugging)")
    p.add_argument(
        "--pool",
        type=int,
        default=None,
        metavar="N",
        help="tokenize on a warm pool of N named actors that stay up between exports, instead "
        "of Ray Data tasks in fresh workers (0: Ray Data). Default: a pool of the cluster's "
        "CPUs when joining a running cluster (--address, RAY_ADDRESS): the first export "
        "creates it, the next find it warm; none with a private local Ray",
    )
    p.add_argument(
        "--pool-idle-s",
        type=float,
        default=300.0,
        help="a pool actor exits (and frees its CPU) after this many seconds without work",
    )


def _check(p: argparse.ArgumentParser) -> None:
    """`check`'s arguments."""
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument(
        "--show", type=int, default=20, help="bad records listed per stream (all are counted)"
    )


def _stats(p: argparse.ArgumentParser) -> None:
    """`stats`' arguments."""
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("--docs", type=int, default=2000, help="documents sampled per stream")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument(
        "--fit",
        type=float,
        default=0.99,
        help="the share of the mixture's documents (at the configured weights) that the "
        "recommended seq_len holds whole",
    )


def _trace(p: argparse.ArgumentParser) -> None:
    """`trace`'s arguments."""
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("--step", required=True, help="a step, a range (41230-41240) or a list")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--out", default=None, help="an export's directory (Parquet or Arrow)")
    src.add_argument(
        "--state", default=None,
        help="a state at or before the step (state-N.json, GET /v1/state): the feed is rebuilt "
        "there and run forward to the step, in this process",
    )  # fmt: skip
    p.add_argument("--rank", type=int, default=None, help="only this rank's rows")
    p.add_argument(
        "--world-size", type=int, default=None,
        help="ranks the rows are split among (None: the export's, else 1)",
    )  # fmt: skip
    p.add_argument("--text", action="store_true", help="also each segment's decoded text")
    p.add_argument("--json", action="store_true", help="one JSON list of segments")


def _corpus(p: argparse.ArgumentParser) -> None:
    """`corpus`' arguments."""
    p.add_argument("--out", default="data/demo", help="the directory to write")


def _demo(p: argparse.ArgumentParser) -> None:
    """`demo`'s arguments."""
    p.add_argument("--steps", type=int, default=60, help="training steps")
    p.add_argument("--json", default=None, help="also write the demo's summary to this file")
    p.add_argument("--out", default=None, help="where to export (None: a temporary directory)")
    p.add_argument("--address", default=None, help=ADDRESS_HELP)
    p.add_argument("--policy", action="store_true",
                   help="turn the mixing policy on (weights that follow each stream's loss)")  # fmt: skip


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
