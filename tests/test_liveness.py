"""A real run can rely on the service: ranks that train slowly on the steps they fetched are
never declared lost (their clients beat), a killed rank still is, the end of the data reaches
every rank after its last step, `serve` outlives its ranks, and ranks find the service
through its record among several Ray clusters. Against real actors and processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import yaml

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import fresh_cache, stdlib_texts, write_jsonl
from tests.rayhead import free_port, patient, wait_http
from trainer.feed import Feed

pytestmark = pytest.mark.slow


def make_cfg(tmp_path, timeout_s: float | None = None, docs: int = 40, repeat: int | None = None):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(docs, max_bytes=3000))
    stream: dict = {"paths": [str(tmp_path / "a.jsonl")]}
    if repeat is not None:
        stream["repeat"] = repeat
    raw = {"seed": 3, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
           "streams": {"a": stream}}  # fmt: skip
    if timeout_s is not None:
        raw["service"] = {"rank_timeout_s": timeout_s}
    return raw


@pytest.fixture
def served(ray_cluster):
    actors = []

    def serve(cfg, name):
        actors.append(start_server(parse_config(cfg), name=name))
        return actors[-1]

    yield serve
    for a in actors:
        ray_cluster.kill(a)


def test_slow_healthy_ranks_are_never_lost(served, tmp_path):
    """Two ranks at 0.5 s a step against a 2.5 s timeout: each fetches up to 32 steps per call
    and is silent on its fetching side for ~16 s while it trains. Beats keep both alive."""
    name = f"slow{os.getpid()}"
    actor = served(make_cfg(tmp_path, timeout_s=2.5, docs=120), name)
    steps, errors, got = 40, [], {0: [], 1: []}
    done = threading.Event()

    def rank(r: int) -> None:
        try:
            feed = Feed.connect(service=name, rank=r, world_size=2, timeout_s=60)
            for _ in range(steps):
                got[r].append(next(feed)["global_step"])
                time.sleep(0.5)  # a training step
        except Exception as e:
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    lost_seen, producer_seen = set(), set()
    while any(t.is_alive() for t in threads):
        st = ray.get(actor.status.remote())
        lost_seen |= set(st["lost_ranks"])
        producer_seen.add(st["producer"])
        time.sleep(0.3)
    done.set()
    assert not errors, errors
    assert not lost_seen, f"healthy slow ranks were declared lost: {lost_seen}"
    assert got[0] == got[1] == list(range(steps))
    assert "window_full" in producer_seen  # the normal state of a plane faster than training
    m = ray.get(actor.metrics.remote())
    for v in m["ranks"].values():
        assert v["consumed_step"] >= steps - 1 and not v["lost"]
        assert v["lag"] <= m["lag_normal_max"]


def test_a_killed_rank_is_declared_lost_within_the_timeout(served, tmp_path):
    name = f"kill{os.getpid()}"
    actor = served(make_cfg(tmp_path, timeout_s=3.0, docs=120), name)
    script = (
        "import sys, time\nfrom trainer.feed import Feed\n"
        "feed = Feed.connect(service=sys.argv[1], rank=1, world_size=2, address=sys.argv[2])\n"
        "next(feed); print('ready', flush=True); time.sleep(600)\n"
    )
    gcs = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-c", script, name, gcs], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(4.0)  # alive and beating: not lost although it does not fetch
        assert 1 not in ray.get(actor.status.remote())["lost_ranks"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while 1 not in ray.get(actor.status.remote())["lost_ranks"]:
            assert time.monotonic() - killed < 3.0 + 3.0, "a killed rank was never declared lost"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_hello_refuses_what_cannot_be_served_before_anything_changes(served, tmp_path):
    """A world that does not divide G, a rank outside it, a state that is not an object, or
    a huge world with a state: refused, and the world already served goes on untouched."""
    name = f"hello{os.getpid()}"
    actor = served(make_cfg(tmp_path), name)
    feed = Feed.connect(service=name, rank=0, world_size=2)
    first = next(feed)["input_ids"].clone()
    state = ray.get(actor.state.remote(0))
    for args in (
        (0, 3, None),
        (0, 2_000_000, state),
        (5, 4, None),
        (0, 0, None),
        (0, 2, [1]),
        (True, 2, None),
        (0, True, None),
    ):  # a bool is no rank or world (True == 1)
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(actor.hello.remote(*args))
    st = ray.get(actor.status.remote())
    assert st["world_size"] == 2 and st["global_step"] < 100
    assert not ray.get(actor.beat.remote(7, 2, 0))  # not a rank of this world: ignored
    ray.get(actor.report_wait.remote(10**9, 1.0))  # rank-keyed telemetry stays in the world
    assert set(ray.get(actor.metrics.remote())["ranks"]) == {"0", "1"}
    again = Feed.connect(service=name, rank=0, world_size=2, state=state)
    assert (next(again)["input_ids"] == first).all()


def test_end_of_data_reaches_each_rank_after_its_last_step(served, tmp_path):
    """`repeat: 1`: every rank receives every step, then StopIteration; the service counts as
    drained only once each rank asked past the end, not when it fetched the last step."""
    name = f"end{os.getpid()}"
    actor = served(make_cfg(tmp_path, docs=10, repeat=1), name)
    feeds = [Feed.connect(service=name, rank=r, world_size=2) for r in range(2)]
    first = [next(f)["global_step"] for f in feeds]
    deadline = time.time() + patient(60)
    while ray.get(actor.status.remote())["producer"] != "ended":
        assert time.time() < deadline
        time.sleep(0.2)
    total = ray.get(actor.status.remote())["global_step"]
    assert 2 <= total <= 32  # the first call fetched every step: all are in the ranks' buffers
    assert not ray.get(actor.drained.remote())
    seen = [[first[r]] + [b["global_step"] for b in feeds[r]] for r in range(2)]
    assert seen == [list(range(total))] * 2
    assert ray.get(actor.drained.remote())
    m = ray.get(actor.metrics.remote())
    assert all(v["ended"] and v["consumed_step"] == total for v in m["ranks"].values())
    with pytest.raises(ray.exceptions.RayTaskError, match="finite"):
        ray.get(actor.report_wait.remote(0, float("nan")))  # /v1/metrics stays JSON
    # The end stays: after the service is gone a rank iterating again (HF's next epoch) stops
    # at once, and its final checkpoint still gets the state after the last step.
    ray.kill(actor)
    for f in feeds:
        assert next(f, None) is None
        assert f.state_dict()["step"] == total


RANK = r"""
import json, sys, time
from trainer.feed import Feed
name, out, step_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
feed = Feed.connect(service=name, rank=0, world_size=1)  # no address: found by its record
steps = []
for batch in feed:
    steps.append(batch["global_step"])
    time.sleep(step_s)  # training on buffered steps, long after the service produced them
time.sleep(2.0)  # e.g. saving a checkpoint: still a Ray client of the service's cluster
json.dump(steps, open(out, "w"))
"""


def test_serve_outlives_its_ranks_at_the_end_of_the_data(ray_cluster, tmp_path):
    """`serve` with its own embedded Ray, beside the session's cluster (two clusters on this
    machine): a rank started without an address finds it through the service record, trains
    slowly on its buffered steps after the data ended, and exits 0 with every step; `serve`
    waits for it and then exits 0 by itself."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(make_cfg(tmp_path, docs=10, repeat=1)))
    env = os.environ | {
        "TOKENMILL_CACHE": str(fresh_cache(tmp_path / "cache")),
        "TOKENMILL_API_TOKEN": "t",
    }
    for key in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS"):
        env.pop(key, None)
    name, port = f"own{os.getpid()}", free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--config", str(cfg), "--port", str(port),
             "--name", name], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
    rank = None
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=120)
        record = json.loads((tmp_path / "cache" / "services" / f"{name}.json").read_text())
        assert record["address"] != ray_cluster.get_runtime_context().gcs_address
        steps_file = tmp_path / "steps.json"
        rank = subprocess.Popen([sys.executable, "-c", RANK, name, str(steps_file), "0.4"],
                                env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
        _, err = rank.communicate(timeout=patient(240))
        assert rank.returncode == 0, err[-3000:]
        steps = json.loads(steps_file.read_text())
        assert steps == list(range(len(steps))) and len(steps) >= 2
        assert serve.wait(timeout=patient(60)) == 0, log.read_text()[-3000:]
        assert "every rank has taken its last step" in log.read_text()
    finally:
        for p in (rank, serve):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_second_serve_of_the_same_name_is_refused(tmp_path, monkeypatch):
    """The record is claimed atomically: a second `serve --name N` on this machine is refused
    before it starts anything, and `stop --name missing` says no such service is recorded."""
    from client.records import ServiceExists, claim, release

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    mine = claim("twice")
    try:
        with pytest.raises(ServiceExists, match="already running"):
            claim("twice")
    finally:
        release(mine)
    # A record whose pid now belongs to another process (pid reuse, a restarted container) is
    # stale: its start time differs.
    from client.records import read_record, service_file

    service_file("reused").write_text(json.dumps(
        {"name": "reused", "pid": os.getpid(), "host": __import__("socket").gethostname(),
         "started": 1, "address": "127.0.0.1:1"}))  # fmt: skip
    assert read_record("reused") is None and not service_file("reused").exists()
    env = os.environ | {"TOKENMILL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "service", "stop", "--name", "missing"],
                         env=env | {"RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=patient(60))  # fmt: skip
    assert out.returncode == 1
    assert "no tokenmill service named 'missing' is recorded" in out.stderr, out.stderr


def test_a_rank_resuming_alone_cannot_leave_the_running_ranks_waiting(served, tmp_path):
    """A resume from a state no longer held restarts the feed there. A rank of the older
    sequence is then told so when it next asks (a clear FeedError naming the resume), instead
    of waiting forever for steps that will never be made."""
    from trainer.feed import FeedError

    name = f"gen{os.getpid()}"
    actor = served(make_cfg(tmp_path, docs=60), name)
    running = Feed.connect(service=name, rank=0, world_size=1)
    first = [next(running)["input_ids"].clone() for _ in range(3)]
    state = ray.get(actor.state.remote(0))  # step 0 was taken and released: a real seek
    resumed = Feed.connect(service=name, rank=0, world_size=1, state=state)
    with pytest.raises(FeedError, match="restarted at step 0 by a rank resuming"):
        for _ in range(200):  # its buffered steps first, then its next call is refused
            next(running)
    again = [next(resumed)["input_ids"] for _ in range(3)]
    assert all((a == b).all() for a, b in zip(again, first, strict=True))
