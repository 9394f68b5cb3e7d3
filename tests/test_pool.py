"""The warm tokenizer pool (pipeline/read/pool.py): the same batches as Ray Data and in-process,
the same actors reused by the next run, and gone once idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.feed import StepFeed
from pipeline.read.pool import NAMESPACE, code_digest, pool_executor, pool_is_warm
from pipeline.read.reading import iter_blocks_local
from tests.conformance import batch_bytes
from tests.rayhead import patient
from tests.test_export import config


def _steps(feed: StepFeed) -> list[bytes]:
    try:
        return [batch_bytes(b) for b in feed]
    finally:
        feed.close()


def _pool_names(ray) -> list[str]:
    prefix = f"tokenmill-tokenize-{code_digest()}-"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]  # fmt: skip


def test_a_warm_pool_makes_the_same_batches_and_outlives_one_run(ray_cluster, corpus):
    ray = ray_cluster
    cfg = config(corpus, "bfd")
    # An actor exits this long after its last unit: long enough for the next run to find it
    # warm (the gap between runs stretches with the machine's load), short enough to see it go.
    idle_s = patient(6)
    want = _steps(StepFeed(cfg, iter_blocks_local))
    assert _steps(StepFeed(cfg, pool_executor(2, idle_s=idle_s))) == want
    assert len(_pool_names(ray)) == 2
    actor = ray.get_actor(sorted(_pool_names(ray))[0], namespace=NAMESPACE)
    pid = ray.get(actor.ready.remote())
    assert _steps(StepFeed(cfg, pool_executor(2, idle_s=idle_s))) == want
    assert ray.get(actor.ready.remote()) == pid, "the second run must find the same warm actor"
    # A warm pool makes the first units too (as a service does: no head start, the tokenizer
    # loaded on a thread), with the same bytes.
    assert pool_is_warm(2) and not pool_is_warm(3)
    warm = pool_executor(2, idle_s=idle_s)
    assert _steps(StepFeed(cfg, warm, warm)) == want
    deadline = time.monotonic() + idle_s + patient(60)
    while _pool_names(ray) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _pool_names(ray), "an idle pool actor must exit and free its CPU"
    assert not pool_is_warm(2)


# A driver that makes one actor of the pool (as an export does: its hold from the creation),
# says the actor's pid and then waits, asking nothing more of it, until it is killed.
HOLDER = """
import sys, time, ray
from pipeline.read.pool import _actor
ray.init(address=sys.argv[1], namespace="tokenmill")
holder = ("killed-export", ray.get_runtime_context().get_job_id())
actor = _actor(90, float(sys.argv[2]), holder)
print(ray.get(actor.ready.remote()), flush=True)
time.sleep(3600)
"""


def test_an_export_holds_its_actors_past_the_idle_time_until_its_driver_is_gone(ray_cluster):
    ray = ray_cluster
    idle_s = patient(3)
    address = ray.get_runtime_context().gcs_address
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    name = f"tokenmill-tokenize-{code_digest()}-90"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, address, str(idle_s)],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        # Held: a starved export asks nothing of an actor for longer than its idle time
        # (pool.py), and the actor must still be there when it does.
        time.sleep(3 * idle_s)
        actor = ray.get_actor(name, namespace=NAMESPACE)
        assert ray.get(actor.ready.remote()) == pid, "a held actor must outlive its idle time"
    finally:
        proc.kill()  # no release comes: the driver's end must drop its hold
        proc.wait()
    deadline = time.monotonic() + idle_s + patient(60)
    while name in _pool_names(ray) and time.monotonic() < deadline:
        time.sleep(1)
    assert name not in _pool_names(ray), "the hold of a killed export must not keep its actor"
