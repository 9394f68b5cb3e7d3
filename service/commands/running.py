"""The commands of a running service: `serve`, `trace` (what a step held), `status`, `stop`;
and `demo` and `corpus`, the demo's run and its corpus."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.config import ConfigError
from pipeline.read.resolve import load_config
from service.commands.resume import documents_to_leave_out, parse_steps, read_state


def service_name(text: str) -> str:
    """argparse's check of `--name` (one rule for every service name: wire/protocol.py)."""
    from wire.protocol import check_service_name

    try:
        return check_service_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_serve(args) -> int:
    from service.serve import run_serve

    cfg = load_config(args.config)
    resume = read_state(args.resume)
    return run_serve(
        cfg, resume=resume, address=args.address, host=args.host,
        port=args.port, name=args.name, allow_config_change=args.allow_config_change,
        leave_out=documents_to_leave_out(args, cfg, resume),
    )  # fmt: skip


def cmd_trace(args) -> int:
    from pipeline.inspect.provenance import RankOutsideWorld, trace

    cfg = load_config(args.config)
    state = read_state(args.state, "--state") if args.state else None
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
