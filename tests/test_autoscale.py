"""A node added: Ray's own autoscaler (its fake multi-node provider, on a host of its own:
tests/hosts.py `autoscaling`) under a service with `service.autoscale`. A rank that waits for
data makes the service ask for CPUs; the autoscaler starts a data node; the warm tokenizer
pool grows onto it; status, Prometheus and the page's line show the nodes. The rank's wait
before and after is printed (on 2 shared cores a second node adds a process, not a core: the
fall is shown where there are cores, not asserted here)."""

import json
import sys
import time

import pytest
import yaml

from tests import hosts as hostlib
from tests.conftest import fresh_cache, stdlib_texts, write_jsonl
from tests.rayhead import patient

pytestmark = pytest.mark.slow
API_PORT = 8000
STEP_S = 0.1  # the rank's own step (a GPU's), after each batch
AFTER_S = 4  # the rank's wait printed over this long, before the request and at the end

# One rank: takes batches, reports each wait (as the adapters do), spends STEP_S on each,
# logs (time, wait) a line a step, until the file `stop` exists.
RANK = r"""
import json, os, sys, time
from trainer.feed import Feed
address, log, stop, step_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
feed = Feed.connect(service="grow", rank=0, world_size=1, address=address, timeout_s=180)
with open(log, "w") as out:
    while not os.path.exists(stop):
        t = time.monotonic()
        next(feed)
        wait = time.monotonic() - t
        feed.report_wait(wait)
        out.write(json.dumps([time.time(), wait]) + "\n")
        out.flush()
        time.sleep(step_s)
feed.close()
"""

# On the head host, one process: polls the service's status (HTTP) until the autoscaler's
# node is up (3 nodes, a change made), then Ray until the pool has an actor on each data node;
# prints the status, the Prometheus text and the pool. One Python with Ray imported for the
# whole wait, not one a poll (each costs ~2 CPU-s: it was a large share of this test).
WATCH = r"""
import json, sys, time, urllib.request
import ray
from client.cluster import connect
base, address, deadline = sys.argv[1], sys.argv[2], time.time() + float(sys.argv[3])
def status():
    try:
        return json.loads(urllib.request.urlopen(base + "/v1/status", timeout=10).read())
    except OSError:
        return None
while True:
    st = status()
    scale = (st or {}).get("autoscale") or {}
    if scale.get("changes") and (scale.get("cluster") or {}).get("nodes") == 3:
        break
    if time.time() > deadline:
        sys.exit(f"no node added: {scale}")
    time.sleep(1)
connect(address)
while True:
    pool = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("tokenmill-tokenize")]
    if len(pool) == 2:
        break
    if time.time() > deadline:
        sys.exit(f"the pool did not grow onto the new node: {pool}")
    time.sleep(1)
st = status()
prom = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
print(json.dumps({"autoscale": st["autoscale"], "prom": prom, "pool": pool}))
"""


def _wait_share(lines: list, start: float, end: float) -> float:
    """The rank's time waiting in [start, end), over its length."""
    waited = sum(w for t, w in lines if start <= t < end)
    return waited / max(1e-9, end - start)


def test_a_waiting_rank_makes_the_autoscaler_add_a_node_that_the_pool_grows_onto(tmp_path):
    why = hostlib.available()
    if why:
        pytest.skip(why)
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(60, max_bytes=20_000))
    # HF's tokenizer and long rows: one tokenizer is behind a rank that takes a step a 0.1 s.
    raw = {"seq_len": 8192, "global_batch_size": 8, "tokenizer": {"backend": "hf"},
           "read": {"block_bytes": 100_000, "first_block_bytes": 20_000},
           "streams": {"code": {"paths": [str(tmp_path / "a.jsonl")], "repeat": 1000}},
           "service": {"autoscale": {"max_cpus": 2, "cooldown_s": 0, "window_s": 8},
                       "control_resources": {"control": 0.01}}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    logs = tmp_path / "logs"
    logs.mkdir()
    with hostlib.autoscaling(logs, {"CPU": 1, "data": 4}, min_data=1, max_data=2) as hosts:
        head = hosts["head"]
        address = f"{head.ip}:{hostlib.GCS_PORT}"
        base = f"http://{head.ip}:{API_PORT}"
        env = hosts.env | {"TOKENMILL_CACHE": str(fresh_cache(tmp_path / "cache"))}
        head.run([sys.executable, "-m", "service", "serve", "--config", str(tmp_path / "c.yaml"),
                  "--address", address, "--host", head.ip, "--port", str(API_PORT),
                  "--name", "grow"], logs / "serve.log", env=env, cwd=tmp_path)  # fmt: skip
        rank_log, stop = tmp_path / "rank.jsonl", tmp_path / "stop"
        rank = head.run([sys.executable, "-c", RANK, address, str(rank_log), str(stop),
                         str(STEP_S)], logs / "rank.log", env=env, cwd=tmp_path)  # fmt: skip

        watch = patient(240)
        r = hosts.python("head", WATCH, base, address, str(watch), env=env, timeout=watch + 60)
        assert r.returncode == 0, r.stderr[-3000:] + hosts.tails()
        assert rank.poll() is None, hosts.tails(4000)
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        scale = seen["autoscale"]
        asked_at = scale["changes"][0]["t"]
        time.sleep(AFTER_S)  # the rank with the pool on both data nodes
        stop.touch()
        rank.wait(timeout=patient(120))
        assert rank.returncode == 0, hosts.tails(4000)
    change = scale["changes"][0]
    assert change["error"] is None and change["requested_cpus"] == 2, change
    assert "ranks waited" in change["reason"], change
    assert scale["cluster"] == {"nodes": 3, "cpus": 2.0}, scale
    assert "tokenmill_cluster_nodes 3.0" in seen["prom"]
    assert "tokenmill_autoscale_requested_cpus 2.0" in seen["prom"]
    lines = [json.loads(x) for x in rank_log.read_text().splitlines()]
    end = lines[-1][0]
    before = _wait_share(lines, asked_at - AFTER_S, asked_at)
    after = _wait_share(lines, end - AFTER_S, end)
    print(
        f"rank's wait: {before:.0%} of the {AFTER_S} s before the request, "
        f"{after:.0%} of the last {AFTER_S} s"
    )
