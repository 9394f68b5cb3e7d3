"""The step window: which produced global steps the server holds, and when it may make more.

Ray-free and clock-injected, so its rules are unit-tested directly (tests/test_window.py).

World. The first rank that says hello declares the world size W. Every rank of that world is
expected, including the ones that have not connected yet: they count as standing at the
window's first step from the moment the world was declared. A rank that asks with another W
gets `WorldMismatch`, unless it resumes from a state (`declare(..., resuming=True)`), which
starts the world again at that state's step.

Retention. A step is held until every live rank of the world has taken it, whatever the order
and timing of their requests: a rank that connects minutes late, or one that pulls K micro-steps
before the first collective, finds every step it has not taken yet.

Liveness follows training, not pulling. A rank fetches up to 32 steps per call and then trains
on them for as long as they take; its client beats (`beat`, from a thread, every few seconds)
with the step it has consumed. Any call or beat is a sign of life. A rank with no sign of life
for `rank_timeout_s` is lost (`None`: never): a killed process, a hung host. A rank that trains
slowly is never lost. A rank that closes its feed says goodbye (`leave`) and is gone at once.
A lost or departed rank stops holding steps back, and if it returns for a step that
was released meanwhile it gets a `StepGone` that names the timeout; one that returns for a step
still held simply carries on.

Where a rank is: `next` is the first step it has not fetched, `consumed` the first it has not
trained on (its client's last report), so `next - consumed` steps sit in its buffer. Lag is
steps consumed behind produced; its normal range reaches the window plus one fetch.

Flow control. The producer may run `prefetch` steps ahead of the slowest live rank and no
further, so at most `prefetch` global steps (prefetch x world x micro-batch rows) are held.
A straggler slows the others by at most that window, never stalls them outright before it,
and never makes the server buffer without bound (unlike `streaming_split`, whose consumers
must advance in lockstep: ray-project/ray#41973, #39595).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wire.protocol import StepGone, WorldMismatch


@dataclass
class RankState:
    next: int  # the first step this rank has not fetched
    seen: float  # clock of its last sign of life: a request, a beat, the world's declaration
    connected: bool = False
    consumed: int | None = None  # the first step it has not trained on, as its client reports
    ended: bool = False  # it was told the data has ended (it had fetched every step)
    # The step of its latest request: a rank asks again only once it has everything before
    # it, so rows held elsewhere (lanes) may go once every rank asked past them. None: `next`.
    asked: int | None = None
    left: bool = False  # it closed its feed (said goodbye): it holds nothing back, as if lost
    # (clock, consumed) from its beats: what it trains on, over time (`consumed_rate`)
    samples: deque = field(default_factory=lambda: deque(maxlen=64))
    # When its current wait for a step not yet made began (a call of its that found nothing
    # to take); None while it is not waiting. The service measures it, as it happens.
    waiting_since: float | None = None


class StepWindow:
    def __init__(
        self,
        start: int,
        prefetch: int,
        rank_timeout_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.start = start  # the first step this window produces
        self.produced = start  # the next step to be produced
        self.prefetch = max(1, prefetch)
        self.rank_timeout_s = rank_timeout_s
        self.clock = clock
        self.steps: dict[int, Any] = {}  # step -> payload, ascending
        self.world: int | None = None
        self.ranks: dict[int, RankState] = {}

    # -- world --------------------------------------------------------------------------------

    def declare(self, rank: int, world_size: int, resuming: bool = False) -> None:
        """A rank joins. The first declares the world; a resuming rank may change it."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if self.world is not None and world_size != self.world:
            if not resuming:
                raise WorldMismatch(
                    f"rank {rank} asked with world size {world_size}, but this service serves a "
                    f"world of {self.world} ranks (declared by the first rank to connect); "
                    "to change the world size, resume every rank from a saved state"
                )
            self.world = None
        if self.world is None:
            now = self.clock()
            first = min(self.steps, default=self.produced)
            self.world = world_size
            self.ranks = {r: RankState(first, now) for r in range(world_size)}
        self.ranks[rank].connected = True
        self.ranks[rank].left = False

    # -- producer side ------------------------------------------------------------------------

    def lost(self, rank: int) -> bool:
        r = self.ranks[rank]
        timeout = self.rank_timeout_s
        return timeout is not None and self.clock() - r.seen > timeout

    def gone(self, rank: int) -> bool:
        """Lost (no sign of life for `rank_timeout_s`) or left (it closed its feed)."""
        return self.ranks[rank].left or self.lost(rank)

    def floor(self) -> int:
        """The lowest step still needed: the slowest live rank's next step. Before any rank
        connects, the window's first step; with every rank lost, the furthest rank's."""
        if self.world is None:
            return self.start
        live = [r.next for k, r in self.ranks.items() if not self.gone(k)]
        if live:
            # A rank back from being lost may stand before the first step still held: those
            # steps are gone for it (StepGone), so it must not hold the producer back.
            return max(min(live), min(self.steps, default=self.produced))
        return max(r.next for r in self.ranks.values())

    def room(self) -> bool:
        """May the producer make step `produced` now?"""
        return self.produced - self.floor() < self.prefetch

    def add(self, step: int, payload: Any) -> None:
        assert step == self.produced, (step, self.produced)
        self.steps[step] = payload
        self.produced += 1
        self.evict()

    def fetched_floor(self) -> int:
        """The first step some live rank may still be fetching from where its rows are held
        (the lanes): every rank has all steps before it. At most `floor()`."""
        if self.world is None:
            return self.start
        live = [r.next if r.asked is None else r.asked
                for k, r in self.ranks.items() if not r.ended and not self.gone(k)]  # fmt: skip
        return min(min(live, default=self.produced), self.floor())

    def evict(self) -> list[int]:
        floor = self.floor()
        gone = [s for s in self.steps if s < floor]
        for s in gone:
            del self.steps[s]
        return gone

    # -- consumer side ------------------------------------------------------------------------

    def beat(self, rank: int, world_size: int, consumed: int) -> bool:
        """A sign of life from rank `rank`, which has consumed every step before `consumed`.
        False if it belongs to another world than the one served (it must reconnect)."""
        if self.world is None or world_size != self.world or not 0 <= rank < self.world:
            return False
        r = self.ranks[rank]
        r.seen = self.clock()
        r.connected = True
        r.consumed = min(int(consumed), r.next)
        r.samples.append((r.seen, r.consumed))
        return True

    def consumed_rate(self, rank: int, window_s: float = 60.0) -> float | None:
        """Steps a second rank `rank` has trained on over the last `window_s` (its beats'
        consumed steps); None with fewer than two beats in that time."""
        now = self.clock()
        recent = [(t, c) for t, c in self.ranks[rank].samples if now - t <= window_s]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        return max(0, recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])

    def waits(self, rank: int) -> None:
        """Rank `rank` asked for a step that is not made yet: its wait begins (if it had not)."""
        r = self.ranks.get(rank)
        if r is not None and r.waiting_since is None:
            r.waiting_since = self.clock()

    def leave(self, rank: int, world_size: int) -> bool:
        """Rank `rank` closed its feed: from now on it holds no step back, at once rather than
        after `rank_timeout_s`, and the other ranks go on (its rows of later steps are not
        delivered to anyone, as for a lost rank). A rank that comes back carries on if its
        step is still held, else gets StepGone. False for another world than the one served."""
        if self.world is None or world_size != self.world or not 0 <= rank < self.world:
            return False
        r = self.ranks[rank]
        r.left = True
        r.seen = self.clock()
        r.waiting_since = None
        self.evict()
        return True

    def end(self, rank: int) -> None:
        """Rank `rank` was told the data has ended: it had fetched and consumed every step
        (it asks past its buffer only when the buffer is spent)."""
        r = self.ranks[rank]
        r.ended = True
        r.consumed = r.next
        r.seen = self.clock()
        r.waiting_since = None

    def drained(self, stopping: bool = False) -> bool:
        """Has every rank of the declared world been told the end (or been lost, or left)?
        False before a world is declared: a rank connecting late must still find every step.
        `stopping` (`tokenmill stop`): ranks that never connected are not waited for, and no
        world at all is drained."""
        if self.world is None:
            return stopping
        return all(r.ended or self.gone(k) or (stopping and not r.connected)
                   for k, r in self.ranks.items())  # fmt: skip

    def take(self, rank: int, world_size: int, step: int) -> Any | None:
        """Rank `rank`'s request for `step`: the payload, or None if not produced yet.

        Raises StepGone for a step released already, WorldMismatch for another world."""
        if self.world is None:
            self.declare(rank, world_size)
        elif world_size != self.world:
            self.declare(rank, world_size)  # raises WorldMismatch
        r = self.ranks[rank]
        was_lost, had_left = self.lost(rank), r.left
        away = self.clock() - r.seen
        r.seen = self.clock()
        r.connected = True
        r.left = False
        if step in self.steps:
            r.next = max(r.next, step + 1)
            r.waiting_since = None
            payload = self.steps[step]
            self.evict()
            return payload
        if step >= self.produced:
            return None
        held = f"{min(self.steps)}..{self.produced - 1}" if self.steps else "none"
        why = (
            f"rank {rank} was away {away:.0f}s, longer than service.rank_timeout_s="
            f"{self.rank_timeout_s:g}, so the other ranks went on without it"
            if was_lost
            else f"rank {rank} had closed its feed, so the other ranks went on without it"
            if had_left
            else f"every rank of the world has taken it, or it precedes step {self.start}, "
            "where this service started"
        )
        raise StepGone(
            f"step {step} is no longer held ({why}); the server holds steps {held}. "
            "Resume every rank from a saved state (Feed.connect(state=...)) instead"
        )

    # -- telemetry ----------------------------------------------------------------------------

    def rank_view(self) -> dict[int, dict]:
        """Per rank: fetched and consumed step, buffered steps, lag (consumed behind produced),
        and its last sign of life. `next_step`, `seen_s_ago` are the older names of
        `fetched_step`, `last_sign_s_ago`."""
        now = self.clock()
        view = {}
        for k, r in sorted(self.ranks.items()):
            at = r.next if r.consumed is None else r.consumed
            sign = now - r.seen if r.connected else None
            view[k] = {
                "fetched_step": r.next,
                "consumed_step": r.consumed,
                "buffered": r.next - at,
                "lag": max(0, self.produced - at),
                "lost": self.lost(k) and not r.left,
                "left": r.left,
                "connected": r.connected,
                "ended": r.ended,
                "last_sign_s_ago": sign,
                # the wait it is in now, measured here as it goes (None: not waiting)
                "waiting_s": None if r.waiting_since is None else now - r.waiting_since,
                "consumed_steps_per_s": self.consumed_rate(k),
                "next_step": r.next,
                "seen_s_ago": sign,
            }
        return view
