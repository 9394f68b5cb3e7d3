"""The batch server's read-outs as pure functions (service/server_view.py): the producer's
state in its order of precedence, why a rank waits, and when a wait is named a stall."""

from __future__ import annotations

import pytest

from service.server_view import STALL_S, producer_state, stall, why_waiting
from wire.protocol import FAILED, FINISHED, RUNNING, STARTING


def state(own=RUNNING, **kw):
    args = {"stopping": False, "paused": False, "busy": False, "waiting_loss": False,
            "room": True} | kw  # fmt: skip
    return producer_state(own, **args)


def test_the_producer_state_goes_by_precedence():
    assert state() == "making"  # room in the window
    assert state(busy=True, room=False) == "making"  # a step under way
    assert state(room=False) == "window_full"
    assert state(STARTING) == "starting"
    assert state(STARTING, busy=True) == "making"
    assert state(waiting_loss=True, room=False) == "waiting_for_loss"
    assert state(paused=True, waiting_loss=True) == "paused"
    assert state(FINISHED, paused=True) == "ended"
    assert state(FAILED, paused=True) == "failed"
    # a stop asked outranks everything: what is made is what the ranks get
    assert state(FAILED, stopping=True) == "stopping"


def rank(next_step=0, waiting_s=None, lost=False, left=False):
    return {"next_step": next_step, "waiting_s": waiting_s, "lost": lost, "left": left}


def test_why_a_rank_waits():
    def never():
        raise AssertionError("the ranks are O(world): asked only when the window is full")

    args = {"paused": False, "policy_waits": None, "producing": False, "floor": 4, "prefetch": 8}
    assert why_waiting(never, **args | {"paused": True}) == "paused"
    assert why_waiting(never, **args | {"policy_waits": (3, 5)}) == (
        "the mixing policy waits for every rank's loss of steps 3-4"
    )
    assert why_waiting(never, **args | {"producing": True}) == "producing"
    ranks = {0: rank(4), 1: rank(9), 2: rank(4, lost=True), 3: rank(4)}
    assert why_waiting(lambda: ranks, **args) == (
        "waiting for rank(s) [0, 3] (prefetch window of 8 steps is full)"
    )


@pytest.mark.parametrize("worst", [0.0, STALL_S - 0.1, STALL_S, 60.0])
def test_a_wait_is_a_stall_from_stall_s(worst):
    ranks = {0: rank(waiting_s=worst), 1: rank(), 2: rank(waiting_s=1e6, lost=True),
             3: rank(waiting_s=1e6, left=True)}  # fmt: skip
    seen = stall(ranks, lambda: "paused")
    assert seen["ranks_waiting_s"] == {"0": worst}  # lost and departed ranks wait for nothing
    if worst >= STALL_S:
        assert seen["stall"] == f"ranks [0] waiting {worst:.0f} s: paused"
    else:
        assert seen["stall"] is None
