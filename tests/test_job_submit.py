"""`ray job submit --working-dir . -- python -m service serve` against `ray start --head`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import RAY, free_port, ray_head, wait_http
from tests.test_serve import CONSUMER

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# A throwaway loopback cluster: no token auth, for the cluster and for the job CLI alike.
# `python` in the entrypoint must be this venv's, as it is the image's python in deploy/.
ENV = os.environ | {
    "RAY_AUTH_MODE": "disabled",
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}
EXCLUDES = [
    ".venv",
    ".git",
    "**/__pycache__",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    "out",
    "data",
]


@pytest.fixture
def head():
    """A separate `ray start --head` cluster with the job server."""
    with ray_head(ENV, dashboard=True) as h:
        yield h


def test_job_submit_serves_a_trainer(head, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(10, max_bytes=3000))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 2, "shuffle": {"window": 2},
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}}))  # fmt: skip
    port = free_port()
    job_id = f"tokenmill-test-{os.getpid()}-{port}"
    deadline = time.time() + 240
    while True:  # the node's job agent comes up a little after the dashboard port opens
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", head["dashboard"], "--no-wait", "--submission-id", job_id,
             "--working-dir", str(ROOT),
             "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--",
             "python", "-m", "service", "serve", "--config", str(cfg), "--port", str(port)],
            capture_output=True, text=True, timeout=180, env=ENV,
        )  # fmt: skip
        if (
            submit.returncode == 0
            or "try again later" not in submit.stderr
            or time.time() > deadline
        ):
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stdout + submit.stderr

    def logs() -> str:
        r = subprocess.run([RAY, "job", "logs", "--address", head["dashboard"], job_id],
                           capture_output=True, text=True, env=ENV)  # fmt: skip
        return r.stdout[-4000:] + r.stderr[-2000:]

    try:
        deadline = time.time() + 180
        while True:
            try:
                wait_http(f"http://127.0.0.1:{port}/healthz", timeout=3)
                break
            except TimeoutError:
                status = subprocess.run([RAY, "job", "status", "--address", head["dashboard"], job_id],
                                        capture_output=True, text=True, env=ENV).stdout  # fmt: skip
                if time.time() > deadline or "FAILED" in status or "SUCCEEDED" in status:
                    pytest.fail(f"the service did not come up; job logs:\n{logs()}")
        out = tmp_path / "r0.json"
        r = subprocess.run([sys.executable, "-c", CONSUMER, head["gcs"], "tokenmill", "0", "1", "3", str(out)],
                           capture_output=True, text=True, timeout=180, env=ENV)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(out.read_text())["got"]
        assert [g["step"] for g in got] == [0, 1, 2]
    finally:
        subprocess.run([RAY, "job", "stop", "--address", head["dashboard"], job_id],
                       capture_output=True, timeout=60, env=ENV)  # fmt: skip
    deadline = time.time() + 60
    while time.time() < deadline:
        st = subprocess.run([RAY, "job", "status", "--address", head["dashboard"], job_id],
                            capture_output=True, text=True, env=ENV)  # fmt: skip
        if any(s in st.stdout for s in ("STOPPED", "SUCCEEDED", "FAILED")):
            break
        time.sleep(1)
