"""tokenmill beside, and on, a foreign `ray start` cluster with token authentication.

The foreign cluster writes its `ray_current_cluster` file where Ray's discovery looks for the
processes under test (TMPDIR), so any command that still joined "whatever it finds" would
land on it. Its token sits in a private file named by RAY_AUTH_TOKEN_PATH; nobody sets
RAY_AUTH_MODE for tokenmill's processes.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient, ray_head, serve_process
from tests.test_serve import CONSUMER

pytestmark = pytest.mark.slow
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


@pytest.fixture(scope="module")
def foreign():
    root = tempfile.mkdtemp(prefix="tf", dir="/tmp")  # Ray's default temp dir: $TMPDIR/ray
    token = Path(root) / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = BASE_ENV | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    try:
        with ray_head(env, temp=f"{root}/ray") as head:
            deadline = time.time() + patient(60)  # `ray start` writes it once the head is up
            while not (Path(root) / "ray" / "ray_current_cluster").exists():
                assert time.time() < deadline, "the foreign cluster did not come up"
                time.sleep(0.5)
            # What a user of this machine has: Ray's temp dir pointing at the foreign cluster,
            # and the cluster's token where Ray documents it. Nothing else.
            yield head | {"env": BASE_ENV | {"TMPDIR": root, "RAY_AUTH_TOKEN_PATH": str(token)}}
    finally:
        # in /tmp, not pytest's tmp_path (Ray's socket paths must stay short): removed here
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def config(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(30, max_bytes=3000))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}}))  # fmt: skip
    return cfg


def tokenmill(*args, env, timeout=None, cwd=None):
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "service", *args], env=env, capture_output=True,
                       text=True, timeout=timeout or patient(300), cwd=cwd)  # fmt: skip
    r.elapsed = time.time() - t
    return r


def test_embedded_export_works_beside_a_foreign_cluster(foreign, config, tmp_path):
    r = tokenmill("export", "--config", str(config), "--out", str(tmp_path / "out"),
                  "--steps", "3", env=foreign["env"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps_written"] == 3


def test_wrong_or_missing_token_is_one_clear_line_within_10s(foreign, config, tmp_path):
    wrong = tokenmill("export", "--config", str(config), "--out", str(tmp_path / "o1"), "--steps", "1",
                      "--address", foreign["gcs"], env=foreign["env"] | {"RAY_AUTH_TOKEN": "wrong"})  # fmt: skip
    assert wrong.returncode != 0 and wrong.elapsed < 10, (wrong.elapsed, wrong.stderr[-2000:])
    assert "refused our auth token" in wrong.stderr and "RAY_AUTH_TOKEN" in wrong.stderr
    home = tmp_path / "home"  # no ~/.ray/auth_token, no RAY_AUTH_TOKEN*
    env = {k: v for k, v in foreign["env"].items() if not k.startswith("RAY_")}
    env |= {"HOME": str(home), "TOKENMILL_CACHE": os.environ["TOKENMILL_CACHE"]}
    missing = tokenmill("export", "--config", str(config), "--out", str(tmp_path / "o2"),
                        "--steps", "1", "--address", foreign["gcs"], env=env)  # fmt: skip
    assert missing.returncode != 0 and missing.elapsed < 10, missing.stderr[-2000:]
    assert "requires an auth token and none was found" in missing.stderr
    errors = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, missing.stderr


def test_a_cluster_without_token_auth_is_followed_whatever_the_client_holds(config, tmp_path):
    """A cluster started without token auth, and a client that holds a token (or even has
    RAY_AUTH_MODE=token set): the client follows the cluster and runs no token mode, whose
    actors such a cluster cancels before they run. An export joining it (its tokenizer pool
    is actors) writes its steps; with the mode set by hand it says it was ignored."""
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    with ray_head(BASE_ENV | {"RAY_AUTH_MODE": "disabled"}) as head:
        env = BASE_ENV | {"RAY_AUTH_TOKEN_PATH": str(token), "TMPDIR": str(tmp_path)}
        for extra, warned in (({}, False), ({"RAY_AUTH_MODE": "token"}, True)):
            out = tmp_path / f"out{int(warned)}"
            r = tokenmill("export", "--config", str(config), "--out", str(out), "--steps", "2",
                          "--address", head["gcs"], env=env | extra, timeout=patient(240))  # fmt: skip
            assert r.returncode == 0, r.stderr[-3000:]
            assert json.loads((out / "summary.json").read_text())["steps_written"] == 2
            assert ("does not use token authentication" in r.stderr) == warned, r.stderr[-2000:]


def test_feed_connect_refuses_to_guess_between_clusters(foreign, ray_cluster):
    """The session's cluster and the foreign one both run here, and no service 'x' is
    recorded: no address is ambiguous, and the error lists the clusters."""
    code = "from trainer.feed import Feed; Feed.connect(service='x', timeout_s=5)"
    r = subprocess.run([sys.executable, "-c", code], env=foreign["env"], capture_output=True,
                       text=True, timeout=patient(60))  # fmt: skip
    assert r.returncode != 0
    assert "Ray clusters run here" in r.stderr and foreign["gcs"].split(":")[1] in r.stderr


def test_serve_on_the_token_cluster_then_stop_sigkill_and_restart(foreign, config, tmp_path):
    name, gcs, env = f"fs{os.getpid()}", foreign["gcs"], foreign["env"]
    with serve_process(config, gcs, name, tmp_path, env) as svc:
        out = tmp_path / "r0.json"
        consumer = subprocess.run([sys.executable, "-c", CONSUMER, gcs, name, "0", "1", "3", str(out)],
                                  env=env, capture_output=True, text=True, timeout=patient(180))  # fmt: skip
        assert consumer.returncode == 0, consumer.stderr[-2000:]
        assert [g["step"] for g in json.loads(out.read_text())["got"]] == [0, 1, 2]
        st = tokenmill("status", "--name", name, "--address", gcs, env=env)
        assert st.returncode == 0 and "running" in st.stdout, st.stderr[-2000:]
        stop = tokenmill("stop", "--name", name, env=env)  # found by its record
        assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr
        assert svc["proc"].wait(timeout=15) == 0

    # A SIGKILLed serve leaves nothing that blocks the next one.
    with serve_process(config, gcs, name, tmp_path, env) as killed:
        killed["proc"].send_signal(signal.SIGKILL)
        killed["proc"].wait(timeout=10)
    with serve_process(config, gcs, name, tmp_path, env) as fresh:
        t = time.time()  # SIGTERM drains and exits within 10 s
        fresh["proc"].send_signal(signal.SIGTERM)
        assert fresh["proc"].wait(timeout=20) == 0
        assert time.time() - t < 10, f"SIGTERM took {time.time() - t:.1f}s"
    # --wait 0: with an address, `status` otherwise waits 30 s for a service still starting
    gone = tokenmill("status", "--name", name, "--address", gcs, "--wait", "0", env=env)
    assert gone.returncode == 1 and "no tokenmill service" in gone.stderr


def test_nothing_calls_ray_init_after_tokenmill_shut_its_ray_down(foreign):
    """A straggling thread's Ray call must fail, not join the cluster Ray would find."""
    code = """
import ray
from client.cluster import connect, shutdown
shutdown(connect(num_cpus=1, object_store_memory=100 << 20))
try:
    ray.put(1)
except Exception as e:
    print("refused:", type(e).__name__)
print("initialized:", ray.is_initialized())
"""
    r = subprocess.run([sys.executable, "-c", code], env=foreign["env"], capture_output=True,
                       text=True, timeout=patient(120))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "initialized: False" in r.stdout, r.stdout
