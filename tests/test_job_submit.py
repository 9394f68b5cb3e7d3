"""README's `ray job submit` command, as written there, against a token-auth `ray start --head`.

The command is read out of README.md, so the doc and the test cannot drift. It runs in a fresh
copy of the checkout's tracked files with the demo corpus built in its `data/` (as a user's
clone would be after `tokenmill corpus --out data/demo`); the copy's examples/demo.yaml gets a
free port, so that the test never takes a port another process holds.
"""

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.rayhead import RAY, free_port, patient, ray_head, wait_http
from tests.test_serve import CONSUMER

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
# `python` in the entrypoint must be this venv's, as it is the image's python in deploy/.
BASE_ENV["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def readme_recipe() -> tuple[dict[str, str], str]:
    """The README's job recipe: the variables its block exports, and its `ray job submit`."""
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "ray job submit" in b]
    assert len(blocks) == 1, "README.md should show one `ray job submit` recipe"
    exports, command = {}, None
    for line in blocks[0].splitlines():
        code = line.split("  #")[0].strip()
        if code.startswith("export "):
            key, _, value = code.removeprefix("export ").partition("=")
            exports[key] = value
        elif code.startswith("ray job submit"):
            command = code
    assert command is not None
    return exports, command


def test_the_readme_recipe_names_what_the_ray_cli_needs():
    exports, command = readme_recipe()
    assert exports["RAY_AUTH_MODE"] == "token"
    assert {"RAY_ADDRESS", "TOKENMILL_API_TOKEN"} <= set(exports)
    assert "--no-wait" in command and "TOKENMILL_API_TOKEN" in command


@pytest.fixture
def head():
    """A separate token-auth `ray start --head` with the job server; its token in a file."""
    root = tempfile.mkdtemp(prefix="tj", dir="/tmp")
    token = Path(root) / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = BASE_ENV | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    try:
        with ray_head(env, dashboard=True, temp=f"{root}/ray") as h:
            yield h | {"token_path": str(token)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def clone(tmp_path):
    """The checkout's tracked files (as they are in the working tree), and the demo corpus."""
    dst = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for name in files.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    r = subprocess.run([sys.executable, "-m", "service", "corpus", "--out", "data/demo"],
                       cwd=dst, capture_output=True, text=True, env=BASE_ENV)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return dst


def ended(cli_output: str) -> bool:
    """Whether `ray job status`/`stop` says the job has ended (Ray's CLI words, not its enum:
    "Job 'raysubmit_...' was stopped", "succeeded", "failed")."""
    return any(w in cli_output for w in ("' was stopped", "' succeeded", "' failed"))


def test_job_submit_as_the_readme_says(head, clone, tmp_path):
    exports, command = readme_recipe()
    config = clone / "examples" / "demo.yaml"
    port = free_port()
    cfg = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump(cfg | {"service": cfg["service"] | {"port": port}}))
    api_token = secrets.token_hex(16)
    env = BASE_ENV | {
        "RAY_ADDRESS": head["dashboard"],
        "RAY_AUTH_MODE": exports["RAY_AUTH_MODE"],
        "RAY_AUTH_TOKEN_PATH": head["token_path"],
        "TOKENMILL_API_TOKEN": api_token,
    }
    deadline = time.time() + patient(240)
    while True:  # the job server and agent come up a little after the dashboard port opens
        submit = subprocess.run(["bash", "-c", command], cwd=clone, capture_output=True,
                                text=True, timeout=patient(180), env=env)  # fmt: skip
        starting = ("try again later", "Connection aborted", "Connection refused")
        if submit.returncode == 0 or not any(s in submit.stderr for s in starting):
            break
        assert time.time() < deadline, submit.stderr
        time.sleep(2)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    (job_id,) = set(re.findall(r"raysubmit_\w+", submit.stdout + submit.stderr))

    def ray_job(*args: str) -> str:
        r = subprocess.run([RAY, "job", *args, job_id], capture_output=True, text=True, env=env)
        return r.stdout[-4000:] + r.stderr[-2000:]

    try:
        deadline = time.time() + patient(180)
        while True:
            try:
                wait_http(f"http://127.0.0.1:{port}/healthz", timeout=20)
                break
            except TimeoutError:  # asked every 20 s: one `ray job` command costs ~2.5 CPU-s
                status = ray_job("status")
                if time.time() > deadline or ended(status):
                    pytest.fail(f"the service did not come up; job logs:\n{ray_job('logs')}")
        # The API token reached the job: a change with it is taken, one without is refused.
        put = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/mixture", method="PUT",
            data=json.dumps({"weights": {"code": 0.6, "chat": 0.4}}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_token}"},
        )  # fmt: skip
        with urllib.request.urlopen(put, timeout=30) as r:
            assert "effective_step" in json.loads(r.read())
        out = tmp_path / "r0.json"
        gcs = {"RAY_AUTH_TOKEN_PATH": head["token_path"]}
        r = subprocess.run([sys.executable, "-c", CONSUMER, head["gcs"], "tokenmill", "0", "1", "3", str(out)],
                           capture_output=True, text=True, timeout=patient(180), env=BASE_ENV | gcs)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert [g["step"] for g in json.loads(out.read_text())["got"]] == [0, 1, 2]
    finally:
        stopped = ray_job("stop")  # returns once the job has ended
    assert ended(stopped), stopped
