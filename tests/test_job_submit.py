"""`ray job submit --working-dir . -- python -m service serve` against `ray start --head`."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.test_serve import CONSUMER, free_port, wait_http

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
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


def wait_listening(port: int, timeout: float = 120.0) -> None:
    """The dashboard answers (Ray's token auth makes it answer 401 to us, which is fine)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {port}")


@pytest.fixture
def head():
    """A separate `ray start --head` cluster (with the job server), stopped by its own pid."""
    gcs, dash = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="tm", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         "--num-cpus=1", "--object-store-memory=200000000", "--include-dashboard=true",
         f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}",
         # Its own agent ports: the session's cluster already holds the defaults (52365...),
         # and a second agent that cannot bind leaves "No available agent to submit job".
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=ENV,
    )  # fmt: skip
    try:
        wait_listening(dash)
        yield {"gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dash}"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


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
