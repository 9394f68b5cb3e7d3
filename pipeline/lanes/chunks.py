"""Which steps the control asks of the lanes, and when: the chunk scheduling of a `LanedFeed`
(lanes/feed.py), kept apart from the lanes' calls and from joining their answers, so that it
is read, and tested, without Ray and without lanes.

A chunk is the same steps asked of every lane at once, one call each. The plan knows the first
step no lane has begun (`asked`), the chunks asked ahead of the one being joined (`pending`)
and how many there may be (`depth`, lanes/depth.py), and which steps every rank has taken and
the lanes may let go (`release`). The feed makes the calls and holds its lock around every
change of a plan: a restart (lanes/group.py) reads the chunks in flight under it.
"""

from __future__ import annotations

import collections

from pipeline.config import Config
from pipeline.lanes.depth import (
    STEPS_PER_CALL,
    in_flight,
    most_in_flight,
    next_depth,
    steps_per_call,
)
from pipeline.stages.policy import window_for


class Chunk:
    """Steps asked of every lane at once, one call each: the first step, how many, and each
    lane's call (a restarted lane's is replaced in place, `LaneGroup.restart`)."""

    __slots__ = ("first", "n", "calls")

    def __init__(self, first: int, n: int, calls: list):
        self.first, self.n, self.calls = first, n, calls


class ChunkPlan:
    """The chunk scheduling of the lanes of `cfg`, from `step` (a start, or a resumed step)."""

    def __init__(self, cfg: Config, step: int):
        self.cfg = cfg
        self.per_call = steps_per_call(cfg.lanes)
        self.pending: collections.deque[Chunk] = collections.deque()  # asked ahead
        self.current: Chunk | None = None  # the chunk being joined
        self.asked = step  # steps asked of every lane: the first step no lane has begun
        self.first = step  # the first call asks STEPS_PER_CALL: the first step comes sooner
        # Chunks asked ahead of the one joined: `in_flight` while the lanes keep ahead, more
        # while the control waits on them (`next_depth`, `most_in_flight`).
        self.depth = self.least = in_flight(cfg.lanes)
        self.most = most_in_flight(cfg)
        # Whether the ranks, not the lanes, set the pace (the batch server's: True once its
        # window was full, False once a rank waited for a step): a chunk not made yet is then
        # no reason to ask further ahead. With ranks that take 64 steps a call, the producer
        # makes each 64 as fast as the lanes can while the ranks train on the last: told only
        # whether the window filled since the last chunk, the control asked 16 chunks ahead
        # most of a run of ranks taking a step per 50 ms (`bench lane-restart --step-ms 50`).
        self.ranks_behind = False
        self.release: int | None = None  # the lanes may let go of steps before this (hold)
        self.told = 0  # the last release the lanes were told
        self.changes: list[tuple[int, list]] = []  # weight changes the lanes have yet to confirm

    def in_flight(self) -> list[Chunk]:
        """The chunks asked and not yet joined, the one being joined first."""
        return [c for c in (self.current, *self.pending) if c is not None]

    def room(self, step: int) -> int:
        """How many steps may be asked now, `step` being the next to hand out: `per_call`, but
        never past the next decision of the mixing policy after `step` (`mixing.policy`): its
        weights are decided (`set_weights`) just before it is made, so no lane may begin it
        earlier. A decision at or before `step` is made already. The first chunk asks at most
        STEPS_PER_CALL: the first step comes sooner."""
        n = self.per_call
        policy = self.cfg.mixing.policy
        if policy is not None:
            for s in range(step + 1, self.asked + self.per_call):
                if window_for(s, policy.every, policy.delay) is not None:
                    n = min(n, s - self.asked)
                    break
        return min(n, STEPS_PER_CALL) if self.asked == self.first else n

    def take(self, n: int) -> tuple[int, int | None]:
        """`n` steps asked: their first step, and the release they carry to the lanes (the
        steps before it every rank has taken; None: nothing new)."""
        first, self.asked = self.asked, self.asked + n
        release, self.release = self.release, None
        if release is not None:
            self.told = release
        return first, release

    def release_alone(self) -> int | None:
        """The release due in a call of its own (no chunk is asked to carry it: the data
        ended, or fewer chunks are asked ahead than are held), once it is a chunk's steps past
        the last one told: the steps made ahead can be many (`most_in_flight`), and a restart
        makes again those a lane holds. None: none due."""
        if self.release is None or self.release - self.told < self.per_call:
            return None
        below, self.release = self.release, None
        self.told = below
        return below

    def wants_more(self) -> bool:
        """Whether fewer chunks are asked ahead than the depth."""
        return len(self.pending) < self.depth

    def follow(self, waited: bool) -> None:
        """The depth after a chunk whose answers the control `waited` for (not made already,
        the lanes had cores, and the ranks did not set the pace): deeper, else back."""
        self.depth = next_depth(self.depth, waited and not self.ranks_behind, self.least,
                                self.most)  # fmt: skip
