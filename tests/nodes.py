"""A Ray cluster of several nodes on this one machine, each its own raylet and object store
(`ray.cluster_utils.Cluster`), owned by a process of its own so that a test can remove a node
(every process of it killed: a node lost) or add one while tokenmill runs on it.

`python -m tests.nodes SPEC`: SPEC is JSON {"head": {...}, "nodes": [{...}, ...]} of
`Cluster.add_node` arguments. It prints one JSON line {"address", "head", "nodes": [node ids]},
then takes JSON lines on stdin: {"remove": node_id} or {"add": {...}}, answering each with a
line; end of input shuts the cluster down. `nodes(...)` is the fixture's context manager.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.rayhead import START_ATTEMPTS, patient, starts_over

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from ray.cluster_utils import Cluster

    spec = json.loads(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args=spec["head"])
    nodes = {}
    for args in spec["nodes"]:
        n = cluster.add_node(**args)
        nodes[n.node_id] = n
    print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id,
                      "nodes": list(nodes)}), flush=True)  # fmt: skip
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if "remove" in cmd:
                cluster.remove_node(nodes.pop(cmd["remove"]), allow_graceful=False)
                print(json.dumps({"removed": cmd["remove"]}), flush=True)
            elif "add" in cmd:
                n = cluster.add_node(**cmd["add"])
                nodes[n.node_id] = n
                print(json.dumps({"added": n.node_id}), flush=True)
    finally:
        cluster.shutdown()


class Nodes:
    def __init__(self, proc: subprocess.Popen, started: dict):
        self.proc = proc
        self.address: str = started["address"]
        self.head: str = started["head"]
        self.nodes: list[str] = started["nodes"]

    def _ask(self, cmd: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def remove(self, node_id: str) -> None:
        """Kill every process of that node (its raylet, object store and workers)."""
        assert self._ask({"remove": node_id}) == {"removed": node_id}
        self.nodes.remove(node_id)

    def add(self, **args) -> str:
        node_id = self._ask({"add": args})["added"]
        self.nodes.append(node_id)
        return node_id


# Ray gives a node's raylet 30 s to register with the GCS (a constant in ray/_private/node.py)
# and raises past it: under the load check (two busy loops beside the suite) a head missed it.
# A cluster whose start timed out so is started again, once, and while `patient(150)` lasts.
TIMED_OUT = "timed out during startup"


def _start(spec: str, env: dict, log: Path) -> tuple[subprocess.Popen, str, str]:
    """The owning process, its first line ('' if it ended first), and its temp dir."""
    temp = tempfile.mkdtemp(prefix="tn", dir="/tmp")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.nodes", spec], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env=env | {"RAY_TMPDIR": temp}, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline(), temp


def _kill(proc: subprocess.Popen, temp: str) -> None:
    """The owning process's group (the nodes' processes started in it), then its temp dir."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait()
    shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def nodes(head: dict, workers: list[dict], env: dict, log: Path):
    """The cluster, up; shut down (and its temp dir removed) at the end. A private temp dir
    (RAY_TMPDIR, short for AF_UNIX paths) keeps its address file from anyone else."""
    spec = json.dumps({"head": head, "nodes": workers})
    deadline = time.monotonic() + patient(150)
    for attempt in range(1, START_ATTEMPTS + 1):
        proc, line, temp = _start(spec, env, log)
        if line:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=patient(60))  # what it says is written
        said = log.read_text()[-3000:]
        _kill(proc, temp)
        if TIMED_OUT not in said or starts_over(attempt, deadline):
            raise AssertionError(f"the cluster did not start, {attempt} time(s):\n{said}")
        print(f"the cluster timed out starting, attempt {attempt}:\n{said}", file=sys.stderr)
    try:
        yield Nodes(proc, json.loads(line))
    finally:
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=patient(60))
        _kill(proc, temp)  # what a shutdown left (or the whole group, if it hung)


if __name__ == "__main__":
    main()
