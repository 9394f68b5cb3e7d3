"""`tokenmill demo`: the main job on the embedded default.

Builds the demo corpus (service/demo_corpus.py), starts an embedded local Ray, and runs the
data plane over it for a bounded number of steps, printing the summary: tokens/s, packing
efficiency, and the realized mixture against the target.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pipeline.config import parse_config
from service.demo_corpus import build_demo_corpus


def demo_config(corpus: Path) -> dict:
    return {
        "seed": 1234,
        "seq_len": 1024,
        "global_batch_size": 16,
        "tokenizer": {"name": "default"},
        "packing": {"mode": "bfd", "buffer": 256, "overflow": "split"},
        "on_error": "skip",
        "streams": {
            "code": {"kind": "pretrain", "paths": [str(corpus / "code.jsonl")], "weight": 0.7},
            "chat": {"kind": "chat", "paths": [str(corpus / "chat.jsonl")], "weight": 0.3},
        },
    }


def run_demo(steps: int = 60, out: str | None = None, address: str | None = None) -> dict:
    from service.cli import _print_summary, _progress
    from service.cluster import connect
    from service.export import run_export

    corpus = build_demo_corpus()
    print(f"demo corpus: {corpus}")
    cfg = parse_config(demo_config(corpus))
    started = connect(address)
    try:
        with tempfile.TemporaryDirectory(prefix="tokenmill-demo-") as tmp:
            summary = run_export(cfg, out or tmp, steps=steps, world_size=2, progress=_progress())
    finally:
        if started:
            import ray

            ray.shutdown()
    _print_summary(summary)
    mixture = {
        name: {"target": st["target_share"], "realized": st["realized_share"]}
        for name, st in summary["streams"].items()
    }
    return summary | {"mixture": mixture}
