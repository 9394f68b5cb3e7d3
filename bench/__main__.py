"""`python -m bench [SUBCOMMAND] [options]` (also `tokenmill bench`, `./dev bench`).

Each subcommand is a module of bench/ with its own options (`python -m bench SUBCOMMAND
--help`; `python -m bench.MODULE` runs the same). With no subcommand, the side-by-side suite:
`python -m bench --quick` is `python -m bench suite --quick`. The figures, what they mean and
the commands that gave them: docs/performance.md.
"""

from __future__ import annotations

import importlib
import sys

# name: (module of bench/, one line). The benches a user runs first, then the probes behind
# the figures of docs/performance.md that say what bounds the throughput.
BENCHES = {
    "suite": ("suite", "the side-by-side suite: the tokenizer's limit and the peers (default)"),
    "e2e": ("e2e", "`tokenmill export` cold and warm against the hand-written script"),
    "scaling": ("scaling", "exported tokens/s against the CPUs Ray has"),
    "serving": ("serve_ranks", "8 model-less ranks served, against the export's steady rate"),
    "lanes": ("lanes", "exports (or, --served, serving) with lanes, against cores"),
    "memory": ("memory", "memory while exporting 5x the object-store cap"),
    "first-batch": (
        "first_batch",
        "`tokenmill serve` against a running cluster to the first batch",
    ),
    "first-steps": ("first_steps", "the ranks' wait in their first steps, against Ray Data"),
    "resume": ("resume", "first batch and resume, early and late in a run"),
    "nodes": ("nodes", "the control's cost a step against K lanes and N data nodes"),
    "shuffle": ("shuffle_quality", "shuffle quality on a corpus sorted by a label"),
}
PROBES = {
    "lane-rates": ("lane_rates", "each lane's own rate, alone on a core (--window: its bursts)"),
    "lane-restart": ("lane_restart", "a lane's process killed mid-run: the ranks' wait"),
    "service-ceiling": ("lane_ceiling", "one service process (or K lanes) with a core of its own"),
    "feed-ceiling": ("feed_ceiling", "one feed's packing and writing, every block tokenized"),
    "reading": ("reading", "reading pre-tokenized input on one core, against fastokens"),
    "verify-cost": ("verify_cost", "what the HF check costs the fast engine, by document size"),
    "lane-profile": ("lane_profile", "where one lane's CPU goes: py-spy samples, callgrind counts"),
    "ramp-reads": ("ramp_reads", "the input read before each draw of the first epoch's ramp"),
}
SUBCOMMANDS = BENCHES | PROBES


def usage() -> str:
    lines = [__doc__.strip(), "", "benches:"]
    lines += [f"  {name:<18}{line}" for name, (_, line) in BENCHES.items()]
    lines += ["", "probes (each behind a figure of docs/performance.md):"]
    lines += [f"  {name:<18}{line}" for name, (_, line) in PROBES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        module, argv = SUBCOMMANDS[argv[0]][0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(f"{usage()}\n\nerror: no subcommand {argv[0]!r}", file=sys.stderr)
        return 2
    else:
        module = "suite"
    return importlib.import_module(f"bench.{module}").main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
