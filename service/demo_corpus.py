"""A demo corpus from text every Python installation has: the standard library's sources.

- `code.jsonl`: pretraining documents, one module's source per record.
- `chat.jsonl`: chat pairs derived from functions with docstrings: the user gives the
  signature and the docstring, the assistant answers with the function's source.

The files are built deterministically (sorted paths, no randomness) and cached, so two
machines with the same Python produce the same corpus.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import textwrap
from pathlib import Path


def _stdlib_files(limit_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files, total = [], 0
    for p in sorted(found):
        size = p.stat().st_size
        if size == 0 or total + size > limit_bytes:
            continue
        files.append(p)
        total += size
    return files


def _chat_pairs(path: Path, source: str):
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        # Whole lines, dedented (ast.get_source_segment re-splits the file on every call).
        body = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        if not body or len(body) > 6000:
            continue
        args = ", ".join(a.arg for a in node.args.args)
        yield {
            "messages": [
                {"role": "system", "content": "You are a careful Python programmer."},
                {
                    "role": "user",
                    "content": f"Write `{node.name}({args})` from `{path.stem}`. It should do this:\n{doc}",
                },
                {"role": "assistant", "content": body},
            ]
        }


def build_demo_corpus(out_dir: str | Path | None = None, limit_bytes: int = 12 << 20) -> Path:
    """Write (once) and return the directory holding code.jsonl and chat.jsonl."""
    if out_dir is None:
        from pipeline.tokenize.files import cache_dir

        tag = f"py{sys.version_info.major}{sys.version_info.minor}-{limit_bytes >> 20}m"
        out_dir = cache_dir() / "demo" / tag
    out_dir = Path(out_dir)
    done = out_dir / ".complete"
    if done.exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    code_tmp, chat_tmp = out_dir / f"code.{os.getpid()}.tmp", out_dir / f"chat.{os.getpid()}.tmp"
    with open(code_tmp, "w") as code, open(chat_tmp, "w") as chat:
        for p in _stdlib_files(limit_bytes):
            try:
                source = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            rel = str(p.relative_to(root))
            code.write(json.dumps({"text": source, "path": rel}) + "\n")
            for pair in _chat_pairs(p, source):
                chat.write(json.dumps(pair) + "\n")
    os.replace(code_tmp, out_dir / "code.jsonl")
    os.replace(chat_tmp, out_dir / "chat.jsonl")
    done.write_text("ok\n")
    return out_dir
