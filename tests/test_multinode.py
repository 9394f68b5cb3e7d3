"""Multi-node on one machine: two `ray start` nodes, each with its own temp dir, with token
auth. The service's batch-server actor is placed on one node (`service.resources`); two trainer
ranks, separate processes, join by address (127.0.0.1) and run their drivers on the other node,
so every batch crosses nodes through Ray's object manager. They get `export --world-size 2`.

Ray turns a loopback node address into the host's own IP (`resolve_ip_for_localhost`), so both
nodes advertise that IP; the cluster is still private: its own GCS port, temp dirs and token."""

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.read.resolve import parse_config
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import free_port, stop_group, wait_http, wait_listening
from tests.test_ranks import exported

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
STEPS = 6
SERVICE_RESOURCE = "tokenmill_service"
TRAINER_RESOURCE = "trainer_node"
# Variables that would send a process to some other cluster, or pin an auth mode.
UNSET = ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")

# Joins the cluster the way tokenmill does (token mode turned on by the token alone) and
# waits until both nodes are alive; prints them.
NODES = r"""
import json, sys, time
import ray
from service.cluster import connect
connect(sys.argv[1])
deadline = time.time() + float(sys.argv[2])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= 2 or time.time() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": n["Resources"]}
                  for n in alive]))
"""

# One trainer rank: its driver's node, the service actor's node, and STEPS batches.
CONSUMER = r"""
import json, sys
import numpy as np
import ray
from ray._private import state
from trainer.feed import Feed
address, name, rank, world, n, out = sys.argv[1:7]
feed = Feed.connect(service=name, rank=int(rank), world_size=int(world), address=address,
                    timeout_s=120)
steps, ids, labels = [], [], []
for _, batch in zip(range(int(n)), feed):
    steps.append(batch["global_step"])
    ids.append(batch["input_ids"].numpy())
    labels.append(batch["labels"].numpy())
actor = state.actors(feed.server._actor_id.hex())
np.savez(out + ".npz", steps=np.array(steps), ids=np.stack(ids), labels=np.stack(labels))
json.dump({"driver_node": ray.get_runtime_context().get_node_id(),
           "service_node": actor["Address"]["NodeID"], "service_state": actor["State"]},
          open(out + ".json", "w"))
"""


def _tokenmill_env(token_file: Path) -> dict:
    """tokenmill's processes: only the token (it turns token mode on by itself)."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env | {"RAY_AUTH_TOKEN_PATH": str(token_file), "PYTHONPATH": path}


def _left_behind(temps: list[str]) -> list[str]:
    """Running processes (zombies aside) whose command line names one of our temp dirs."""
    import psutil

    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(t in cmd for t in temps):
            left.append(f"{p.pid} {cmd[:200]}")
    return left


def _tails(tmp_path: Path, n: int = 3000) -> str:
    logs = sorted(tmp_path.glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in logs)


def _ports() -> list[str]:
    """Every port a node opens, chosen here: other clusters on this machine hold the defaults."""
    flags = ["dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "node-manager-port", "object-manager-port"]  # fmt: skip
    return [f"--{flag}={free_port()}" for flag in flags]


def _start_nodes(tmp_path: Path, ray_env: dict, temps: list[str], procs: list) -> str:
    """Start the head (marked `trainer_node`) and a second node (marked `tokenmill_service`)
    with ports of their own; returns the GCS address. Appends the `ray start` processes."""
    port = free_port()
    gcs = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus=1", "--object-store-memory=200000000"]
    head = [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}", f"--temp-dir={temps[0]}",
            f"--resources={json.dumps({TRAINER_RESOURCE: 1})}", *common, *_ports()]  # fmt: skip
    second = [RAY, "start", f"--address={gcs}", f"--temp-dir={temps[1]}",
              f"--resources={json.dumps({SERVICE_RESOURCE: 1})}", *common, *_ports()]  # fmt: skip
    for i, cmd in enumerate((head, second)):
        with open(tmp_path / f"node{i}.log", "a") as log:  # the child keeps its own copy
            kw = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
            procs.append(subprocess.Popen(cmd, env=ray_env, **kw))
        if i == 0:  # the GCS must answer before anyone probes it (CI saw it take >7 s)
            wait_listening(port, timeout=120)  # the second node retries on its own
    return gcs


@pytest.fixture
def two_nodes(tmp_path):
    """A private two-node cluster: token auth with a token of its own; stopped by its own pids.

    `ray start` gives a raylet a fixed 30 s to register with its GCS and then exits; on a
    loaded 2-core machine that happened once (CI). A node that exits during start-up is an
    infrastructure failure, not tokenmill's: the cluster is started again, once, from scratch.
    """
    token_file = tmp_path / "ray_token"
    token_file.write_text(secrets.token_hex(32))
    base = {k: v for k, v in os.environ.items() if k not in UNSET}
    ray_env = base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    env = _tokenmill_env(token_file)
    temps, procs = [], []
    try:
        for attempt in range(2):
            temps += [tempfile.mkdtemp(prefix="tm", dir="/tmp") for _ in range(2)]  # AF_UNIX
            gcs = _start_nodes(tmp_path, ray_env, temps[-2:], procs)
            r = subprocess.run(
                [sys.executable, "-c", NODES, gcs, "180"],
                capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
            )  # fmt: skip
            node_died = any(p.poll() is not None for p in procs[-2:])
            if r.returncode == 0 or attempt == 1 or not node_died:
                break
            for p in reversed(procs[-2:]):
                with contextlib.suppress(Exception):
                    stop_group(p)
        assert r.returncode == 0, r.stderr[-3000:] + _tails(tmp_path)
        nodes = json.loads(r.stdout.strip().splitlines()[-1])
        if len(nodes) < 2:
            pytest.fail(f"the two nodes did not come up: {nodes}\n" + _tails(tmp_path))
        node_of = {
            res: next(n["id"] for n in nodes if res in n["resources"])
            for res in (TRAINER_RESOURCE, SERVICE_RESOURCE)
        }
        assert node_of[TRAINER_RESOURCE] != node_of[SERVICE_RESOURCE]
        assert len({n["ip"] for n in nodes}) == 1, nodes  # one machine
        yield {"gcs": gcs, "env": env, "node_of": node_of}
    finally:
        for p in reversed(procs):  # the second node first, then the head
            with contextlib.suppress(Exception):  # the leftover check below tells
                stop_group(p)
        left = _left_behind(temps)
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def test_two_ranks_on_another_node_get_the_export(two_nodes, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(30, max_bytes=3000))
    raw = {"seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
           "service": {"resources": {SERVICE_RESOURCE: 0.01}},
           "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}}  # fmt: skip
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    want = exported(parse_config(raw), tmp_path, STEPS, 2)  # no Ray: local, in this process

    gcs, env, node_of = two_nodes["gcs"], two_nodes["env"], two_nodes["node_of"]
    port, name = free_port(), f"mn{os.getpid()}"
    outs = [tmp_path / f"rank{r}" for r in range(2)]
    kw = {"cwd": tmp_path, "env": env, "stderr": subprocess.STDOUT, "start_new_session": True}
    procs = []
    with open(tmp_path / "serve.log", "w") as serve_log:
        try:
            serve = subprocess.Popen(
                [sys.executable, "-m", "service", "serve", "--config", str(cfg_path),
                 "--address", gcs, "--port", str(port), "--name", name],
                stdout=serve_log, **kw,
            )  # fmt: skip
            procs.append(serve)
            try:
                wait_http(f"http://127.0.0.1:{port}/healthz", timeout=240)
            except TimeoutError:
                pytest.fail("the service did not come up\n" + _tails(tmp_path))
            args = [sys.executable, "-c", CONSUMER, gcs, name]
            ranks = [
                subprocess.Popen(
                    [*args, str(r), "2", str(STEPS), str(outs[r])],
                    stdout=subprocess.PIPE,
                    text=True,
                    **kw,
                )
                for r in range(2)
            ]
            procs += ranks
            for r, p in enumerate(ranks):
                try:
                    text, _ = p.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"rank {r} did not finish\n" + _tails(tmp_path))
                assert p.returncode == 0, f"rank {r}:\n{text[-4000:]}\n" + _tails(tmp_path)

            for r, out in enumerate(outs):
                where = json.loads(out.with_suffix(".json").read_text())
                assert where["service_state"] == "ALIVE"
                # The actor is where its resources put it, the rank's driver on the other node.
                assert where["service_node"] == node_of[SERVICE_RESOURCE], where
                assert where["driver_node"] == node_of[TRAINER_RESOURCE], where
                got = np.load(out.with_suffix(".npz"))
                assert got["steps"].tolist() == list(range(STEPS))
                assert got["ids"].shape == (STEPS, 2, 64)
                for s in range(STEPS):
                    msg = f"rank {r} step {s}"
                    np.testing.assert_array_equal(got["ids"][s], want[(s, r)][0], err_msg=msg)
                    np.testing.assert_array_equal(got["labels"][s], want[(s, r)][1], err_msg=msg)
            a, b = (np.load(o.with_suffix(".npz"))["ids"] for o in outs)
            assert not np.array_equal(a, b), "the two ranks must get different rows"

            serve.send_signal(signal.SIGTERM)
            try:  # a second or two; generous for a loaded machine
                assert serve.wait(timeout=20) == 0, _tails(tmp_path)
            except subprocess.TimeoutExpired:
                pytest.fail("serve did not exit within 20 s of SIGTERM\n" + _tails(tmp_path))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
