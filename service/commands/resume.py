"""What a resumed command reads: a state file (`--resume`) and the documents to leave out
(`--skip-steps`, `--skip-docs`); `export`, `serve` and `trace` share them."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.config import ConfigError


def read_state(path: str | None, flag: str = "--resume") -> dict | None:
    if not path:
        return None
    from pipeline.state.resume import StateError, load_state

    try:
        return load_state(path)
    except StateError as e:  # not JSON, or JSON that is not an object (`null` is no state)
        raise ConfigError(f"{flag} {e}") from None


def parse_steps(text: str) -> list[int]:
    """`12`, `41230-41240` or `3,7,9-11`: the steps, ascending, each once."""
    from pipeline.inspect.provenance import parse_steps as parse

    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"--step {e}") from None


def documents_to_leave_out(args, cfg, resume: dict | None, out: Path | None = None):
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
