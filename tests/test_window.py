"""The Ray-free step window: world, retention and flow control, on a fake clock."""

import pytest

from service.window import StepWindow
from wire.protocol import StepGone, WorldMismatch


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def fill(w: StepWindow) -> list[int]:
    """Produce while the window has room; the steps produced."""
    made = []
    while w.room():
        made.append(w.produced)
        w.add(w.produced, f"batch{w.produced}")
    return made


def make(prefetch=3, timeout=600.0, start=0):
    clock = Clock()
    return StepWindow(start, prefetch, timeout, clock=clock), clock


def test_before_anyone_connects_the_window_fills_to_prefetch():
    w, _ = make(prefetch=3)
    assert fill(w) == [0, 1, 2]
    assert not w.room() and w.world is None


def test_a_late_rank_finds_every_step_the_early_one_took():
    w, clock = make(prefetch=3)
    fill(w)
    w.declare(0, 2)
    for s in range(3):
        assert w.take(0, 2, s) == f"batch{s}"
    assert not w.room(), "rank 1 has not taken step 0: the producer must wait"
    clock.t += 300  # five minutes late, inside the timeout
    for s in range(3):
        assert w.take(1, 2, s) == f"batch{s}"
    assert fill(w) == [3, 4, 5]


def test_out_of_order_connects_and_accumulation_beyond_prefetch():
    w, _ = make(prefetch=2)
    fill(w)
    assert w.take(1, 2, 0) == "batch0"  # rank 1 declares the world
    assert w.take(1, 2, 1) == "batch1"
    assert w.take(1, 2, 2) is None and not w.room()  # accumulating: waits for rank 0
    assert w.take(0, 2, 0) == "batch0"
    assert fill(w) == [2]
    assert w.take(1, 2, 2) == "batch2"
    assert w.take(0, 2, 1) == "batch1"
    assert fill(w) == [3]
    assert sorted(w.steps) == [2, 3], "held: what some rank has not taken, nothing more"


def test_memory_stays_bounded_by_prefetch_with_a_straggler():
    w, _ = make(prefetch=4)
    w.declare(0, 2)
    w.declare(1, 2)
    fast, slow, held = 0, 0, []
    for tick in range(200):
        fill(w)
        held.append(len(w.steps))
        while w.take(0, 2, fast) is not None:
            fast += 1
        if tick % 10 == 0 and w.take(1, 2, slow) is not None:
            slow += 1
    assert max(held) <= 4
    assert fast - slow <= 4 and slow == 20


def test_a_rank_away_longer_than_the_timeout_is_lost_then_gets_a_clear_step_gone():
    w, clock = make(prefetch=2, timeout=600)
    w.declare(0, 2)
    fill(w)
    clock.t += 601  # rank 1 never came
    assert w.lost(1)
    assert w.rank_view()[1]["lost"] is True
    for s in range(6):
        assert w.take(0, 2, s) == f"batch{s}"
        fill(w)
    with pytest.raises(StepGone, match="rank_timeout_s=600"):
        w.take(1, 2, 0)


def test_a_lost_rank_that_returns_for_a_held_step_carries_on():
    w, clock = make(prefetch=3, timeout=10)
    w.declare(0, 2)
    fill(w)
    w.take(1, 2, 0)
    clock.t += 11
    assert w.rank_view()[1]["lost"]
    assert w.beat(0, 2, 0)  # rank 0 alive meanwhile
    assert w.take(1, 2, 1) == "batch1"
    assert not w.rank_view()[1]["lost"]


def test_no_timeout_means_a_step_waits_for_every_rank_forever():
    w, clock = make(prefetch=2, timeout=None)
    w.declare(0, 2)
    fill(w)
    w.take(0, 2, 0)
    w.take(0, 2, 1)
    clock.t += 1e9
    assert not w.room() and not w.rank_view()[1]["lost"]
    assert w.take(1, 2, 0) == "batch0"


def test_every_rank_lost_does_not_run_away():
    w, clock = make(prefetch=2, timeout=5)
    w.declare(0, 1)
    fill(w)
    w.take(0, 1, 0)
    clock.t += 6
    fill(w)
    assert w.produced - max(r.next for r in w.ranks.values()) <= 2


def test_a_different_world_size_is_refused_unless_resuming():
    w, _ = make()
    w.declare(0, 2)
    with pytest.raises(WorldMismatch, match="world of 2 ranks"):
        w.declare(0, 4)
    with pytest.raises(WorldMismatch):
        w.take(3, 4, 0)
    w.declare(0, 4, resuming=True)
    assert w.world == 4 and set(w.ranks) == {0, 1, 2, 3}


def test_rank_outside_the_world_is_refused():
    w, _ = make()
    with pytest.raises(ValueError, match="outside world size"):
        w.declare(2, 2)


def test_a_window_started_from_a_state_begins_at_its_step():
    w, _ = make(start=40)
    assert fill(w) == [40, 41, 42]
    with pytest.raises(StepGone, match="precedes step 40"):
        w.take(0, 1, 39)
    assert w.take(0, 1, 40) == "batch40"


def test_steps_taken_by_every_rank_are_released():
    w, _ = make(prefetch=3)
    fill(w)
    for r in (0, 1):
        w.take(r, 2, 0)
    assert 0 not in w.steps
    with pytest.raises(StepGone, match="every rank of the world has taken it"):
        w.take(0, 2, 0)


def test_a_lost_rank_back_behind_the_released_steps_holds_nothing_back():
    """Rank 1 was lost, its steps released; its beats make it live again, but what it stood
    before is gone for it (StepGone), so the producer still has room for rank 0."""
    w, clock = make(prefetch=2, timeout=10)
    w.declare(0, 2)
    fill(w)
    clock.t += 11  # rank 1 silent: lost
    for s in range(6):
        w.take(0, 2, s)
        fill(w)
    floor = w.floor()
    assert floor == 6  # rank 0's next step
    assert w.beat(1, 2, 0)  # it beats again (a lingering process)
    assert not w.lost(1) and w.floor() == floor  # it holds nothing back
    with pytest.raises(StepGone):
        w.take(1, 2, 0)


def test_beats_keep_a_rank_that_does_not_fetch_alive_and_report_where_it_trains():
    w, clock = make(prefetch=3, timeout=10)
    w.declare(0, 1)
    fill(w)
    for s in range(3):
        w.take(0, 1, s)
    for consumed in range(3):  # training on its 3 fetched steps, 8 s each
        clock.t += 8
        assert w.beat(0, 1, consumed)
        assert not w.lost(0)
    view = w.rank_view()[0]
    assert view["consumed_step"] == 2 and view["fetched_step"] == 3 and view["buffered"] == 1
    assert not w.beat(0, 2, 0) and not w.beat(5, 1, 0)  # another world, another rank: ignored
    clock.t += 11
    assert w.lost(0)  # no sign of life


@pytest.mark.parametrize(
    "slow_leaves", [True, False], ids=["slow leaves first", "fast leaves first"]
)
def test_a_rank_that_leaves_holds_nothing_back_at_once(slow_leaves):
    """A rank that closes its feed says goodbye. The slow one leaving: the fast one goes on at
    once (not after the 600 s timeout). The fast one leaving: the slow one still gets every
    step. The data's end counts a departed rank done, status tells it apart from a lost one,
    and one that comes back for a step released meanwhile hears why."""
    w, clock = make(prefetch=3)
    slow, fast = 0, 1
    for r in (slow, fast):
        w.declare(r, 2)
    fill(w)
    for s in range(3):
        assert w.take(fast, 2, s) == f"batch{s}"
    assert not w.room()  # the slow rank holds steps 0-2
    leaver, stayer = (slow, fast) if slow_leaves else (fast, slow)
    assert w.leave(leaver, 2)
    view = w.rank_view()[leaver]
    assert view["left"] and not view["lost"]
    got = []
    while len(got) < 6:  # no clock moved: at once
        fill(w)
        step = (got[-1] + 1) if got else (3 if slow_leaves else 0)
        assert w.take(stayer, 2, step) == f"batch{step}"
        got.append(step)
    assert got == (list(range(3, 9)) if slow_leaves else list(range(6)))
    w.end(stayer)
    assert w.drained()
    assert not w.leave(0, 4)  # another world
    with pytest.raises(StepGone, match="closed its feed"):
        w.take(leaver, 2, 0 if slow_leaves else 1)


def test_a_ranks_current_wait_and_consumed_rate_are_measured_as_they_happen():
    w, clock = make(prefetch=2)
    w.declare(0, 1)
    fill(w)
    assert w.take(0, 1, 0) and w.take(0, 1, 1)
    assert w.rank_view()[0]["waiting_s"] is None
    w.waits(0)  # it asked for step 2, not made
    clock.t += 7.5
    w.waits(0)  # asking again keeps the wait's start
    assert w.rank_view()[0]["waiting_s"] == 7.5
    fill(w)
    assert w.take(0, 1, 2) and w.rank_view()[0]["waiting_s"] is None
    for consumed in (0, 1, 3):  # at most what it fetched (3)
        w.beat(0, 1, consumed)
        clock.t += 5
    assert w.consumed_rate(0) == pytest.approx(3 / 10)
    clock.t += 120  # beats older than the window: no rate
    assert w.consumed_rate(0) is None
