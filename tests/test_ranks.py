"""Ranks as they arrive in real runs, against a real batch-server actor on the session's Ray:
late and out of order, accumulating ahead, one 10x slower than the other, and 64 at once
while the API keeps answering."""

import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import ray

from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from service.export import run_export
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient
from trainer.feed import Feed
from wire.layout import read_step
from wire.protocol import TENSOR_COLUMNS

pytestmark = pytest.mark.slow


RANKS = r"""
import sys, threading, numpy as np
import ray
from trainer.feed import Feed
gcs, name, world, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
got = {}
def rank(r):
    feed = Feed.connect(service=name, rank=r, world_size=world, address=gcs)
    got[r] = [next(feed)["input_ids"].numpy() for _ in range(steps)]
threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
for t in threads: t.start()
for t in threads: t.join()
np.savez(out, ids=np.stack([np.stack(got[r]) for r in range(world)]))
"""


def make_cfg(tmp_path, G=4, L=64, lanes=1, **extra):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(40, max_bytes=3000))
    return parse_config({"seed": 7, "seq_len": L, "global_batch_size": G, "shuffle": {"window": 4},
                         "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}},
                         **({"lanes": lanes} if lanes > 1 else {}), **extra})  # fmt: skip


# Small pieces and units, so that the first epoch's ramp reads its pieces in parts
# (stages/plan.py `ramp_parts`) in the service, where an export reads them whole.
RAMP_IN_PARTS = {"shuffle": {"window": 4, "piece_bytes": 16384, "pieces": 8},
                 "read": {"first_block_bytes": 16384}}  # fmt: skip


@pytest.fixture
def served(ray_cluster):
    actors = []

    def serve(cfg, name, prefetch):
        actors.append(start_server(cfg, name=name, prefetch=prefetch))
        return actors[-1]

    yield serve
    for a in actors:
        ray_cluster.kill(a)


def wait_produced(actor, steps: int, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while ray.get(actor.status.remote())["global_step"] < steps:
        assert time.time() < deadline, "the service produced nothing"
        time.sleep(0.2)


def pull(name, rank, world, n, out, delay_s=0.0, start_after_s=0.0):
    """A simulated rank: connect (maybe late), take `n` steps, keep its rows by step."""
    from trainer.feed import Feed

    time.sleep(start_after_s)
    feed = Feed.connect(service=name, rank=rank, world_size=world, timeout_s=60)
    for _ in range(n):
        batch = next(feed, None)
        if batch is None:
            break
        out.append((batch["global_step"], batch["input_ids"].numpy(), batch["labels"].numpy()))
        time.sleep(delay_s)


def exported(cfg, tmp_path, steps, world):
    out = tmp_path / f"export-w{world}"
    run_export(cfg, out, steps=steps, world_size=world, executor=iter_blocks_local)
    rows = {}
    for r in range(world):
        for s in range(steps):
            t = read_step(out / f"step-{s:08d}-rank-{r}.parquet")
            ids = np.array(t.column("input_ids").to_pylist())
            labels = np.array(t.column("labels").to_pylist())
            rows[(s, r)] = (ids, labels)
    return rows


def assert_equal_to_export(got: dict[int, list], want: dict, steps: int):
    for rank, taken in got.items():
        assert [s for s, _, _ in taken] == list(range(steps)), f"rank {rank}: steps in order"
        for s, ids, labels in taken:
            np.testing.assert_array_equal(ids, want[(s, rank)][0])
            np.testing.assert_array_equal(labels, want[(s, rank)][1])


@pytest.mark.parametrize("lanes", [1, 2])
def test_late_out_of_order_ranks_with_accumulation_equal_the_export(served, tmp_path, lanes):
    """With lanes too: the lanes keep every step the late rank has not taken. The service
    reads the ramp's pieces in parts, the export whole: the same rows."""
    from pipeline.stages.plan import StreamPlan

    cfg = make_cfg(tmp_path, lanes=lanes, **RAMP_IN_PARTS)
    plans = [StreamPlan("a", cfg, lane, lanes).plan(0, (), 0)[0] for lane in range(lanes)]
    assert all(any(p.take >= 0 for u in units for p in u.pieces) for units in plans)
    steps = 10
    name = f"late{os.getpid()}"
    actor = served(cfg, name, prefetch=2)
    wait_produced(actor, 2)  # the producer fills its window before anyone connects
    # A rank's first batch imports torch (`to_torch`): 2.4 s here idle, and past rank 0's 6 s
    # head start under load when no earlier test had imported it (run with fewer files).
    import torch  # noqa: F401

    got = {0: [], 1: []}
    # Rank 1 connects first and pulls a burst of micro-steps beyond the prefetch window
    # (gradient accumulation); rank 0 arrives 6 s later. Neither may get StepGone.
    threads = [
        threading.Thread(target=pull, args=(name, 1, 2, steps, got[1])),
        threading.Thread(target=pull, args=(name, 0, 2, steps, got[0], 0.0, 6.0)),
    ]
    for t in threads:
        t.start()
    deadline = time.time() + patient(30)
    while len(got[1]) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    m = ray.get(actor.metrics.remote())
    assert m["world_size"] == 2 and m["ranks"]["0"]["connected"] is False
    assert m["held_steps"] <= 2, "rank 0 absent: the window holds, it does not grow"
    assert len(got[1]) == 2, "rank 1 ran ahead to the end of the window, then waited"
    for t in threads:
        t.join(timeout=patient(120))
    assert_equal_to_export(got, exported(cfg, tmp_path, steps, 2), steps)


def test_a_rank_asking_with_another_world_size_gets_a_clear_error(served, tmp_path):
    from trainer.feed import Feed, FeedError

    cfg = make_cfg(tmp_path)
    name = f"world{os.getpid()}"
    served(cfg, name, prefetch=2)
    Feed.connect(service=name, rank=0, world_size=2)
    with pytest.raises(FeedError, match="serves a world of 2 ranks"):
        Feed.connect(service=name, rank=0, world_size=4)


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_straggler_10x_slower_loses_nothing_and_memory_stays_bounded(served, tmp_path, lanes):
    """With lanes too: the straggler holds the lanes' rows back, the window bounds them."""
    cfg = make_cfg(tmp_path, lanes=lanes)
    steps, prefetch = 12, 3
    name = f"strag{os.getpid()}"
    actor = served(cfg, name, prefetch=prefetch)
    got = {0: [], 1: []}
    threads = [
        threading.Thread(target=pull, args=(name, 0, 2, steps, got[0], 0.02)),
        threading.Thread(target=pull, args=(name, 1, 2, steps, got[1], 0.2)),
    ]
    for t in threads:
        t.start()
    held, lead, lags = [], [], []
    while any(t.is_alive() for t in threads):
        m = ray.get(actor.metrics.remote())
        held.append(m["held_steps"])
        lead.append(len(got[0]) - len(got[1]))
        if m["ranks"]:
            lags.append(m["ranks"]["1"]["lag"])
        time.sleep(0.05)
    assert max(held) <= prefetch, f"held steps {max(held)} > prefetch {prefetch}"
    # Each rank fetches up to Feed.LOOKAHEAD produced steps per call: the straggler holds
    # those it fetched, so the fast rank may consume that much further ahead.
    assert max(lead) <= prefetch + Feed.LOOKAHEAD, "the fast rank ran ahead only so far"
    assert max(lead) >= prefetch - 1, "the fast rank was served ahead, not held in lockstep"
    assert max(lags) >= 1, "the straggler's lag is reported"
    assert_equal_to_export(got, exported(cfg, tmp_path, steps, 2), steps)


@pytest.mark.parametrize("world", [2, 4])
def test_a_lanes_process_killed_mid_run_loses_and_repeats_nothing(served, tmp_path, world):
    """A lane's process killed with SIGKILL while the ranks train (their client's own code:
    `Feed.connect`) and the metrics are asked meanwhile: the service starts the lane again
    from its state and every rank gets the export's rows, step for step, none lost or
    repeated (`service.lane_restarts`). World 2: each rank's rows in one lane; world 4: two
    ranks a lane."""
    import signal

    cfg = make_cfg(tmp_path, lanes=2)
    steps = 40
    name = f"killed{world}{os.getpid()}"
    actor = served(cfg, name, prefetch=3)
    got = {r: [] for r in range(world)}
    threads = [threading.Thread(target=pull, args=(name, r, world, steps, got[r], 0.02))
               for r in range(world)]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.time() + patient(120)
    while min(len(g) for g in got.values()) < 8:
        assert time.time() < deadline, "the ranks did not start"
        time.sleep(0.05)
    pid = ray.get(actor.metrics.remote())["lanes"][1]["pid"]
    os.kill(pid, signal.SIGKILL)
    restarted = []
    while any(t.is_alive() for t in threads):
        restarted = ray.get(actor.metrics.remote())["lanes_restarted"]
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert [r["lane"] for r in restarted] == [1], restarted
    m = ray.get(actor.metrics.remote())
    assert m["lanes"][1]["pid"] != pid and m["lanes"][1]["restarts"] == 1
    assert_equal_to_export(got, exported(cfg, tmp_path, steps, world), steps)


def test_64_ranks_pull_while_the_api_answers(served, tmp_path):
    """64 simulated ranks (threads of one other process, as on a trainer node), and the
    API, in this process as in `serve`'s, polled over HTTP meanwhile."""
    import uvicorn

    from service.api import Backend, create_app
    from tests.rayhead import free_port

    world, steps = 64, 6
    cfg = make_cfg(tmp_path, G=64, L=32)
    name = f"load{os.getpid()}"
    actor = served(cfg, name, prefetch=2)
    port = free_port()
    api = uvicorn.Server(uvicorn.Config(create_app(Backend(actor)), port=port, log_level="warning"))
    api.install_signal_handlers = lambda: None
    threading.Thread(target=api.run, daemon=True).start()
    while not api.started:
        time.sleep(0.05)
    out = tmp_path / "ranks.npz"
    gcs = ray.get_runtime_context().gcs_address
    ranks = subprocess.Popen([sys.executable, "-c", RANKS, gcs, name, str(world), str(steps), str(out)])  # fmt: skip
    latencies, errors, deadline = [], [], time.time() + patient(240)
    while ranks.poll() is None or len(latencies) < 20:
        if time.time() > deadline:
            ranks.kill()
            pytest.fail("64 ranks did not finish within 240 s")
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=10) as r:
                assert r.status == 200
        except OSError as e:
            errors.append(repr(e))
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    api.should_exit = True
    assert ranks.returncode == 0 and not errors
    got = np.load(out)["ids"]  # [rank, step, row, L]
    assert got.shape[:2] == (world, steps), "every rank got every step"
    want = exported(cfg, tmp_path, steps, 1)
    for s in range(steps):  # rank r of 64 has row r of each global step, no more, no less
        np.testing.assert_array_equal(got[:, s].reshape(world, -1), want[(s, 0)][0])
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"\n/v1/status under 64 ranks: n={len(latencies)} p50={statistics.median(latencies) * 1e3:.1f}ms "
          f"p99={p99 * 1e3:.1f}ms max={max(latencies) * 1e3:.1f}ms")  # fmt: skip
    assert p99 < 5.0, "the API must stay responsive (a hang guard, not a benchmark)"


def test_a_rank_away_past_the_timeout_is_reported_lost_and_told_why(served, tmp_path):
    from trainer.feed import Feed, FeedError

    cfg = make_cfg(tmp_path)
    cfg = cfg.model_copy(update={"service": cfg.service.model_copy(update={"rank_timeout_s": 3.0})})
    name = f"lost{os.getpid()}"
    actor = served(cfg, name, prefetch=2)
    got = []
    pull(name, 0, 2, 6, got)  # rank 1 never comes: after 3 s rank 0 goes on without it
    assert [s for s, _, _ in got] == list(range(6))
    st = ray.get(actor.status.remote())
    assert st["lost_ranks"] == [1] and ray.get(actor.metrics.remote())["ranks"]["1"]["lost"]
    late = Feed.connect(service=name, rank=1, world_size=2)
    with pytest.raises(FeedError, match=r"rank_timeout_s=3"):
        next(late)


@pytest.mark.parametrize(
    "slow_leaves", [True, False], ids=["slow leaves first", "fast leaves first"]
)
def test_a_rank_that_closes_its_feed_never_holds_the_others(served, tmp_path, slow_leaves):
    """Two ranks under the default 600 s rank timeout, prefetch 2. One closes its feed after 1
    step: the other takes 8 more steps at once, each equal to the export's, and status says
    which rank left (not lost)."""
    cfg = make_cfg(tmp_path)
    want = exported(cfg, tmp_path, 9, 2)
    name = f"left{os.getpid()}{int(slow_leaves)}"
    actor = served(cfg, name, prefetch=2)
    leaver, stayer = (0, 1) if slow_leaves else (1, 0)
    feed = Feed.connect(service=name, rank=leaver, world_size=2, timeout_s=60)
    first = next(feed)
    np.testing.assert_array_equal(first["input_ids"].numpy(), want[(0, leaver)][0])
    if not slow_leaves:  # the fast one ran ahead first; the slow one still finds every step
        wait_produced(actor, 2)
    feed.close()
    got: list = []
    t0 = time.monotonic()
    pull(name, stayer, 2, 9, got)
    assert time.monotonic() - t0 < 60, "held back by the rank that left"
    assert_equal_to_export({stayer: got}, want, 9)
    st = ray.get(actor.status.remote())
    assert st["left_ranks"] == [leaver] and st["lost_ranks"] == []
    assert ray.get(actor.metrics.remote())["ranks"][str(leaver)]["left"]


@pytest.mark.parametrize("chat", [False, True])
def test_served_batches_equal_the_full_export_in_every_column(served, tmp_path, chat):
    """The service sends the compact layout and the rank derives `position_ids`, `segment_ids`
    and, unless a segment masks tokens, `labels`. Pretraining alone (labels derived), and with
    a chat stream mixed in (masked prompts: steps carry `labels`): every tensor column of every
    served step equals the full-layout export's."""
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(40, max_bytes=3000))
    chats = [{"messages": [{"role": "user", "content": f"Q{i}? " * (i % 7 + 1)},
                           {"role": "assistant", "content": f"A{i}. " * (i % 5 + 2)}]}
             for i in range(60)]  # fmt: skip
    write_jsonl(tmp_path / "c.jsonl", chats)
    streams = {"a": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.6}}
    if chat:
        streams["c"] = {"kind": "chat", "paths": [str(tmp_path / "c.jsonl")], "weight": 0.4}
    cfg = parse_config({"seed": 3, "seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": streams})  # fmt: skip
    steps, name = 8, f"cols{int(chat)}{os.getpid()}"
    out = tmp_path / "full"
    run_export(cfg, out, steps=steps, world_size=2, executor=iter_blocks_local, layout="full")
    served(cfg, name, prefetch=2)
    feeds = [Feed.connect(service=name, rank=r, world_size=2, timeout_s=60) for r in range(2)]
    for s in range(steps):
        for r, feed in enumerate(feeds):
            got = next(feed)
            want = read_step(out / f"step-{s:08d}-rank-{r}.parquet")
            assert got["global_step"] == s
            assert got["seq_lens"] == want.column("seq_lens").to_pylist()
            for col in TENSOR_COLUMNS:
                np.testing.assert_array_equal(
                    got[col].numpy(), np.array(want.column(col).to_pylist()), err_msg=f"{col} {s}"
                )
