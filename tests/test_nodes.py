"""The plane on several Ray nodes of this machine (tests/nodes.py: each its own raylet and
object store): a head that holds the control, two data nodes that hold the lanes, spread one
a node, and four ranks that pull while a data node is lost. The cluster runs without token auth,
which the clients follow (they hold a token; in token mode their actors would be cancelled)."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.read.resolve import parse_config
from tests.conftest import fresh_cache, stdlib_texts, write_jsonl
from tests.nodes import nodes
from tests.rayhead import patient, serve_process
from tests.test_ranks import exported

pytestmark = pytest.mark.slow
WORLD = 4  # ranks (tests/test_hosts.py runs 2, across hosts)
STEPS = 160  # well past what the lanes make ahead (64 steps) when the node is lost
UNSET = ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_TMPDIR")
MB = 1 << 20

# W ranks of one process (threads; W the 6th argument, default 2), pulling slowly; each
# step's rows saved.
RANKS = r"""
import os, sys, threading, time, numpy as np
from trainer.feed import Feed
address, name, steps, out, delay = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
world = int(sys.argv[6]) if len(sys.argv) > 6 else 2
got, errors = {}, []
def rank(r):
  try:
    feed = Feed.connect(service=name, rank=r, world_size=world, address=address, timeout_s=120)
    rows = []
    for i in range(steps):
        if i == 10:  # told where they are, then held until the test has removed a node
            open(f"{out}.at10.{r}", "w").close()
            while not os.path.exists(f"{out}.go"):
                time.sleep(0.05)
        b = next(feed)
        rows.append((b["global_step"], b["input_ids"].numpy(), b["labels"].numpy()))
        time.sleep(delay)
    got[r] = rows
    feed.close()
  except BaseException:  # a rank that fails fails the process
    import traceback
    errors.append(traceback.format_exc())
threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
for t in threads: t.start()
for t in threads: t.join()
if errors:
    sys.exit("\n".join(errors))
np.savez(out, **{f"{r}_{k}": np.stack([x[i] for x in got[r]]) for r in got
                 for i, k in enumerate(("steps", "ids", "labels"))})
"""


def _metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/metrics", timeout=patient(10)) as r:
        return json.loads(r.read())


def _lane_nodes(port: int, n: int, timeout_s: float = 120) -> list[str]:
    deadline = time.time() + patient(timeout_s)
    while True:
        lanes = _metrics(port).get("lanes") or []
        found = [lane.get("node_id") for lane in lanes]
        if len(found) == n and all(found):
            return found
        assert time.time() < deadline, f"the lanes did not say where they run: {lanes}"
        time.sleep(0.5)


def lost_node_config(tmp_path: Path, world: int) -> dict:
    """The run a node is lost in: two files (each lane reads whole pieces), `lanes: 2` on
    the `data` nodes, the control on `control`, as tmp_path/c.yaml; returns its export's rows
    for `world` ranks (tests/test_ranks.py `exported`)."""
    for name in ("a", "b"):
        write_jsonl(
            tmp_path / f"{name}.jsonl", stdlib_texts(60, start=60 * (name == "b"), max_bytes=3000)
        )
    raw = {"seed": 5, "seq_len": 64, "global_batch_size": 4, "lanes": 2, "shuffle": {"window": 4},
           "streams": {"a": {"paths": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]}},
           "service": {"resources": {"data": 1}, "control_resources": {"control": 0.01},
                       "lane_restarts": 3}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return exported(parse_config(raw), tmp_path, STEPS, world)


def assert_rows_are_the_export(out: Path, want: dict, world: int) -> None:
    """What RANKS saved: every step exactly once, byte for byte the export's."""
    rows = np.load(out)
    for r in range(world):
        assert rows[f"{r}_steps"].tolist() == list(range(STEPS))
        for s in range(STEPS):
            np.testing.assert_array_equal(rows[f"{r}_ids"][s], want[(s, r)][0])
            np.testing.assert_array_equal(rows[f"{r}_labels"][s], want[(s, r)][1])


def test_lanes_spread_over_data_nodes_and_a_lost_node_loses_no_step(tmp_path):
    want = lost_node_config(tmp_path, WORLD)
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    token = tmp_path / "token"  # the clients hold a token; the cluster asks none
    token.write_text("a" * 64)
    env |= {
        "TOKENMILL_CACHE": str(fresh_cache(tmp_path / "cache")),
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    store = {"object_store_memory": 100 * MB}
    head = {"num_cpus": 0, "resources": {"control": 1}, **store}
    data = {"num_cpus": 2, "resources": {"data": 4}, **store}
    nodes_env = env | {"RAY_AUTH_MODE": "disabled"}
    with (
        nodes(head, [data, data], nodes_env, tmp_path / "nodes.log") as c,
        serve_process(tmp_path / "c.yaml", c.address, "multi", tmp_path, env) as svc,
    ):
        placed = _lane_nodes(svc["port"], 2)
        assert sorted(placed) == sorted(c.nodes), (placed, c.nodes)  # one lane a data node
        out = tmp_path / "rows.npz"
        ranks = subprocess.Popen([sys.executable, "-c", RANKS, c.address, "multi", str(STEPS),
                                  str(out), "0.02", str(WORLD)], env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.time() + patient(120)
        while not all(Path(f"{out}.at10.{r}").exists() for r in range(WORLD)):  # 10 steps in
            assert time.time() < deadline and ranks.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        c.remove(placed[0])
        Path(f"{out}.go").touch()
        _, err = ranks.communicate(timeout=patient(300))
        assert ranks.returncode == 0, err[-3000:] + svc["log"].read_text()[-3000:]
        m = _metrics(svc["port"])
        # Lane 0 only (twice at most: a lane started again while the lost node is still
        # counted alive may land there and die with it, then starts on the survivor).
        assert {r["lane"] for r in m["lanes_restarted"]} == {0}, m["lanes_restarted"]
        assert len(m["lanes_restarted"]) <= 2, m["lanes_restarted"]
        now = [lane["node_id"] for lane in m["lanes"]]
        assert now[0] == placed[1] and now[1] == placed[1], now  # the survivor holds both
    assert_rows_are_the_export(out, want, WORLD)
