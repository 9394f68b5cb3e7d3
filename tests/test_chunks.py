"""The chunk scheduling of a laned feed (pipeline/lanes/chunks.py), without Ray or lanes: how
many steps a chunk asks, never past the mixing policy's next decision, the releases carried
and sent alone, and the depth that follows the lanes unless the ranks set the pace."""

from __future__ import annotations

from pipeline.config import Config
from pipeline.lanes.chunks import ChunkPlan
from pipeline.lanes.depth import STEPS_PER_CALL, in_flight, most_in_flight, steps_per_call


def config(lanes: int = 4, **extra):
    return Config.model_validate({"seq_len": 64, "global_batch_size": 8, "lanes": lanes,
                         "streams": {"a": {"paths": ["a.jsonl"]}, "b": {"paths": ["b.jsonl"]}},
                         **extra})  # fmt: skip


def test_the_first_chunk_is_short_and_the_next_ones_whole():
    plan = ChunkPlan(config(lanes=4), step=10)  # a resumed run: its first chunk is short too
    per_call = steps_per_call(4)
    assert per_call > STEPS_PER_CALL
    assert plan.room(10) == STEPS_PER_CALL
    assert plan.take(STEPS_PER_CALL) == (10, None)
    assert plan.asked == 10 + STEPS_PER_CALL
    assert plan.room(10) == per_call
    assert plan.take(per_call) == (10 + STEPS_PER_CALL, None)


def test_no_chunk_asks_past_the_policys_next_decision():
    # Decisions take effect at steps 8k + 3 (k >= 1): 11, 19, 27...
    cfg = config(lanes=4, mixing={"policy": {"every": 8, "delay": 3}})
    plan = ChunkPlan(cfg, step=0)
    plan.take(plan.room(0))  # steps 0-3
    assert plan.room(0) == 11 - plan.asked  # up to the decision at 11, not into it
    plan.take(plan.room(0))
    assert plan.asked == 11 and plan.room(0) == 0  # 11 waits for its decision
    assert plan.room(11) == steps_per_call(4)  # decided (11 handed out next): 11-18 may go
    plan.take(plan.room(11))
    assert plan.asked == 19 and plan.room(11) == 0 and plan.room(19) > 0


def test_a_release_rides_the_next_chunk_or_goes_alone_a_chunk_at_a_time():
    plan = ChunkPlan(config(lanes=2), step=0)
    per_call = steps_per_call(2)
    plan.release = 3
    assert plan.take(STEPS_PER_CALL) == (0, 3) and plan.told == 3 and plan.release is None
    assert plan.take(per_call) == (STEPS_PER_CALL, None)  # nothing new to tell
    plan.release = 3 + per_call - 1
    assert plan.release_alone() is None  # less than a chunk's steps since the last told
    plan.release = 3 + per_call
    assert plan.release_alone() == 3 + per_call and plan.told == 3 + per_call
    assert plan.release is None and plan.release_alone() is None


def test_the_depth_follows_the_lanes_unless_the_ranks_set_the_pace():
    cfg = config(lanes=2)
    plan = ChunkPlan(cfg, step=0)
    least, most = in_flight(2), most_in_flight(cfg)
    assert plan.depth == least < most
    plan.follow(waited=True)
    assert plan.depth == min(most, 2 * least)
    plan.ranks_behind = True  # a chunk not made yet is no reason to ask further ahead
    plan.follow(waited=True)
    assert plan.depth == min(most, 2 * least) - 1
    while plan.depth > least:
        plan.follow(waited=False)
    plan.follow(waited=False)
    assert plan.depth == least  # never below
    plan.ranks_behind = False
    for _ in range(20):
        plan.follow(waited=True)
    assert plan.depth == most  # never above
    assert plan.wants_more() and not plan.in_flight()
