"""The warm tokenizer pool (pipeline/read/pool.py): the same batches as Ray Data and in-process,
the same actors reused by the next run, and gone once idle."""

from __future__ import annotations

import time

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
