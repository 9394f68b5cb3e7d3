"""The data plane installs and runs without torch (issue 14: packaging).

torch and mosaicml-streaming are extras (`trainer`, `mds`): a CPU data node leaves them out.
These tests run the CLI in a fresh process where both are unimportable, as if not installed:
a `sitecustomize` on PYTHONPATH refuses them, in the driver and, through the inherited
environment, in every Ray worker of the embedded cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient

BLOCKED = ("torch", "torchvision", "streaming")

SITECUSTOMIZE = f"""
import importlib.abc, os, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            with open(os.environ["TOKENMILL_BLOCK_LOG"], "a") as f:
                f.write(f"{{os.getpid()}} {{name}}\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def _env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "TOKENMILL_RAY"))
    }
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(root), env.get("PYTHONPATH", "")])
    env["TOKENMILL_BLOCK_LOG"] = str(tmp_path / "blocked.log")
    return env


def _run(args: list[str], env: dict[str, str], timeout: int = 240):
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


def test_the_blocker_blocks(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=_env(tmp_path)
    )
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr


@pytest.mark.slow
def test_export_runs_without_torch_or_streaming(tmp_path):
    env = _env(tmp_path)
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(30))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "seq_len": 128, "global_batch_size": 2, "packing": {"mode": "concat"},
        "streams": {"code": {"paths": ["a.jsonl"]}},
    }))  # fmt: skip
    r = _run(["check", "--config", str(cfg)], env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # The embedded Ray: its workers inherit PYTHONPATH, so they cannot import torch either.
    r = _run(["export", "--config", str(cfg), "--out", str(tmp_path / "o"), "--steps", "3"], env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["steps_written"] == 3
    assert summary["streams"]["code"]["tokens"] == 3 * 2 * 128


def test_mds_without_streaming_is_a_clear_error(tmp_path):
    env = _env(tmp_path)
    mds = tmp_path / "mds"
    mds.mkdir()
    (mds / "index.json").write_text(json.dumps({"version": 2, "shards": []}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"streams": {"m": {"paths": [str(mds)], "format": "mds"}}}))
    r = _run(["check", "--config", str(cfg)], env, timeout=patient(120))
    assert r.returncode != 0
    assert "pip install 'tokenmill[mds]'" in r.stdout + r.stderr, r.stdout + r.stderr
