"""The K lanes of a laned feed as the control holds them (`LaneGroup`): each started (in this
process, or in a Ray actor of its own, spread over the nodes that can hold it), called and
answered (asked again of its new actor when its process died), started again from a kept
state (lanes/restart.py), checked, shown (metrics `lanes`), asked for its figures, closed.

What the lanes are asked to make, and how their answers join into global steps, is the feed's
(lanes/feed.py `LanedFeed`); a restart asks the feed what it has in flight (`in_flight`), so
that the new actor is asked again, in order, what the dead one was."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pipeline.config import Config
from pipeline.lanes.depth import steps_per_call
from pipeline.lanes.handles import ActorLane, LocalLane, lane_died
from pipeline.lanes.placing import NotPlaced, not_placed
from pipeline.lanes.restart import Restarts
from pipeline.lanes.steps import LanedStep, LaneError, LaneMade, Receipt
from pipeline.lanes.worker import LaneWorker
from pipeline.state.summary import RunSummary
from wire.arrays import from_ipc
from wire.lane_rows import TAKE_GROUP, TAKE_THREADS, join_parts

# What the feed has asked of the lanes and not yet joined, under its lock: the chunks asked
# (each with `first`, `n` and its lanes' `calls`), the first step no lane has begun, and the
# weight changes set without waiting that the lanes have yet to confirm.
InFlight = Callable[[], tuple[list, int, list[tuple[int, list]]]]


class LaneGroup:
    """K lanes, each started with its `args` (LaneWorker's): in this process (`local`), one
    after the other, else each in its Ray actor. `hold`: the lanes keep the steps they make
    (ranks take their rows from them), and a lane whose process died is started again up to
    `restarts` times. `lock` is the feed's (a restart replaces a call of a chunk in flight);
    `in_flight` says what the feed has asked of the lanes. `wait_for_figures` False (the batch
    server): `summaries` answers with the lanes' last ones and asks again in the background."""

    def __init__(self, cfg: Config, args: list[tuple], *, local: bool, hold: bool,
                 restarts: int, state_every: int, lock: threading.RLock, in_flight: InFlight,
                 wait_for_figures: bool = True):  # fmt: skip
        self.cfg = cfg
        self.args = args
        self.hold = hold
        self.state_every = state_every
        self._lock = lock
        self._in_flight = in_flight
        self.lanes = self._start_all(local)
        # One list shared by every step the feed makes (a restarted lane's actor replaces its
        # entry): where ranks take a step's rows (LanedStep `handles`).
        self.handles = [getattr(lane, "handle", None) for lane in self.lanes]
        # A holding lane whose process died is started again from its state at the oldest
        # step it held (lanes/restart.py). Lanes give states at every step only with
        # `state_every` 1.
        self.restarts = Restarts(restarts if hold and state_every == 1 else 0)
        self.closed = False  # closed, or replaced by a skip: no restart
        K = len(self.lanes)
        # The steps each lane held when it last answered (holding lanes: metrics `lanes`),
        # and its making_s, making_process_s last answered (the feed's depth).
        self.last: list[Receipt | LaneMade] = [Receipt(0, 0, [], [])] * K
        self.making = [(0.0, 0.0)] * K
        self.wait_for_figures = wait_for_figures
        self._summaries: list | None = None
        self._asking: list | None = None

    def __len__(self) -> int:
        return len(self.lanes)

    def _start_all(self, local: bool) -> list[LocalLane | ActorLane]:
        """Every lane: in this process (`local`), else each in its actor, none left waiting to
        be placed if one cannot be started."""
        if local:
            return [LocalLane(LaneWorker(*a)) for a in self.args]
        lanes: list[LocalLane | ActorLane] = []
        try:
            for k, a in enumerate(self.args):
                lanes.append(self._start(k, a))
        except BaseException:
            for lane in lanes:
                lane.kill()
            raise
        return lanes

    def _start(self, k: int, args: tuple, expect: dict[int, str] | None = None) -> ActorLane:
        """Lane k's actor, with `args` (LaneWorker's), and the states it is to make (`expect`,
        a restart's). Its first call that waits for an answer waits for it to be placed and
        started, up to `service.place_timeout_s` (lanes/placing.py)."""
        import ray

        # Holding lanes hand out rows on threads of their own (`take`), beside the one
        # thread (the default group) that makes steps, changes weights and gives states.
        groups = {"concurrency_groups": {TAKE_GROUP: TAKE_THREADS}} if self.hold else {}
        actor = ray.remote(num_cpus=0, max_restarts=0, **groups)(  # type: ignore[call-overload]
            LaneWorker
        )
        resources = self.cfg.service.resources
        # SPREAD: the lanes go to different nodes of those that can hold them (the data nodes,
        # with `service.resources`), not wherever the scheduler packs them first.
        opts: dict = {"scheduling_strategy": "SPREAD"}
        if resources:
            opts["resources"] = dict(resources)
        handle = actor.options(**opts).remote(*args, expect=expect)
        return ActorLane(handle, f"lane {k} of {len(self.args)}", resources,
                         self.cfg.service.place_timeout_s)  # fmt: skip

    # -- calls --------------------------------------------------------------------------------

    def answer_of(self, calls: list, k: int) -> Any:
        """Lane k's answer to its call in `calls` (a chunk's, a weight change's): asked again
        of the lane's new actor when its process died and it was restarted (`restart`, which
        replaces the call in `calls`). A lane that failed otherwise fails the feed, by name."""
        while True:
            lane = self.lanes[k]  # before the call: a restart replaces the call first
            call = calls[k]
            try:
                return lane.get(call)
            except Exception as e:
                if not self.restart(k, lane, e):
                    raise self.failure(k, e) from e

    def ask(self, k: int, method: str) -> Any:
        """Lane k's answer to `method` (its state, its summary), asked again of its new actor
        if it died meanwhile."""
        while True:
            lane = self.lanes[k]
            try:
                return lane.get(lane.call(method))
            except Exception as e:
                if not self.restart(k, lane, e):
                    raise self.failure(k, e) from e

    def failure(self, k: int, error: BaseException) -> LaneError:
        """Lane k's failure, named (one not placed names itself)."""
        if isinstance(error, NotPlaced):
            return LaneError(str(error))
        return LaneError(f"lane {k} of {len(self.lanes)} failed: {error}")

    def made(self, asked: list) -> bool:
        """Whether every lane (actors: holding lanes are) has answered `asked` already."""
        import ray

        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=0)
        return len(ready) == len(asked)

    def joined(self, step: LanedStep, timeout_s: float = 120.0) -> pa.RecordBatch:
        """Held step `step`, joined whole from its lanes' parts. A lane whose process died is
        started again (`restart`) and its part asked of the new actor, which makes the step
        again first (LaneWorker `_held`); a lane that fails otherwise is named."""
        import ray

        parts = []
        for k in range(len(self.lanes)):
            while True:
                lane = self.lanes[k]
                handle = lane.handle  # type: ignore[union-attr]  # holding lanes are actors
                call = handle.part.options(concurrency_group=TAKE_GROUP).remote(step.step)
                try:
                    parts.append(from_ipc(ray.get(call, timeout=timeout_s)))
                    break
                except Exception as e:
                    if not self.restart(k, lane, e):
                        raise self.failure(k, e) from e
        return join_parts(parts)

    # -- a lane whose process died ------------------------------------------------------------

    def restart(self, k: int, lane: Any, error: BaseException) -> bool:
        """Lane k (`lane`, the one that failed with `error`) started again from its kept state
        (lanes/restart.py), if its process died and it has restarts left: True once lane k is
        another actor (this call's, or another thread's that met the death first).

        The new actor is asked again, in order, what lane k was asked since that state; each
        state it answers is checked against the one lane k gave for that step
        (`check_remade`). Ranks that met the dead actor ask the server for the new one
        (`check_lane`), and their takes of steps it has yet to make again wait for them
        (LaneWorker `_held`)."""
        if not lane_died(error):
            return self.lanes[k] is not lane
        import ray

        with self._lock:
            if self.lanes[k] is not lane:
                return True  # restarted already, by the thread that met it first
            if not self.restarts.can_restart(k) or self.closed:
                return False
            step, state, expect = self.restarts.start_of(k)
            args = list(self.args[k])
            args[2] = state
            new = self._start(k, tuple(args), expect=expect)
            with contextlib.suppress(Exception):  # one taken for dead stays so (a partition)
                ray.kill(lane.handle)  # type: ignore[union-attr]  # actors only (lane_died)
            chunks, asked, changes = self._in_flight()
            self.restarts.ask_again(k, new, step, state, chunks, asked,
                                    steps_per_call(len(self.lanes)), self.state_every,
                                    changes)  # fmt: skip
            self.lanes[k] = new
            self.handles[k] = new.handle
            self.making[k] = (0.0, 0.0)
            self._asking = None  # the summaries asked of the dead actor never come
            nth = self.restarts.logged(k, step, asked - step, type(error).__name__)
        print(f"tokenmill: lane {k} of {len(self.lanes)} died ({type(error).__name__}); "
              f"started again from step {step} (restart {nth} of {self.restarts.limit})",
              file=sys.stderr, flush=True)  # fmt: skip
        return True

    def check_remade(self) -> None:
        """The answers of the steps a restarted lane made again, as they come: a lane that
        made one otherwise than before (LaneWorker `expect`) fails the feed."""
        with self._lock:
            remade = self.restarts.remade
            ready = [r for r in remade if r[1].ready(r[2])]
            self.restarts.remade = [r for r in remade if r not in ready]
        for k, lane, call in ready:
            try:
                lane.get(call)
            except Exception as e:
                if self.restart(k, lane, e):
                    continue
                raise self.failure(k, e) from e

    def check_lane(self, k: int, timeout_s: float = 10.0) -> None:
        """A rank met lane k's actor dead (wire/lane_rows.py LaneGone): restarted here if it is
        (the producer may be waiting for room, not for the lane, and not meet it)."""
        import ray

        lane = self.lanes[k]
        if not isinstance(lane, ActorLane):
            return  # in this process: nothing dies apart
        ping = lane.handle.process.options(concurrency_group=TAKE_GROUP).remote()
        ready, _ = ray.wait([ping], timeout=timeout_s)
        if not ready:
            return  # busy or starting: the rank asks again
        try:
            ray.get(ping)
        except Exception as e:
            self.restart(k, lane, e)

    def check_placed(self) -> None:
        """Fails the feed (LaneError) if a lane's actor was not placed and started within
        `service.place_timeout_s`: one a rank's call started again (`check_lane`) while the
        producer waits for room, not for the lanes."""
        for lane in self.lanes:
            if isinstance(lane, ActorLane) and lane.overdue():
                assert lane.place_timeout_s is not None  # overdue says so
                raise LaneError(str(not_placed(lane.what, lane.resources, lane.place_timeout_s)))

    # -- figures ------------------------------------------------------------------------------

    def view(self) -> list[dict]:
        """Each lane: its process (pid, host; None until it has said, and `waiting_s` the
        seconds it has waited to be placed and started), how many times it was started again
        (`restart`) and, when the lanes hold the rows, the steps it held when it last answered
        (the window's steps, those not yet released, and those made ahead) and its seconds
        making steps by then, wall and CPU (`making_s`, `making_cpu_s`)."""
        out = []
        now = time.monotonic()
        for k, lane in enumerate(self.lanes):
            where = {"pid": None, "host": None, "node_id": None, "node_ip": None}
            started = lane.ready(lane.where)
            if started:
                with contextlib.suppress(Exception):  # a lane that died says nothing
                    where = lane.get(lane.where)
            # Seconds it has waited to be placed and started (lanes/placing.py); None once
            # it has started: a lane started again where no node has its resources shows.
            waiting = None if started else round(now - lane.since, 1)  # type: ignore[union-attr]
            last = self.last[k] if self.hold else None
            out.append({"lane": k, **where, "waiting_s": waiting,
                        "restarts": self.restarts.count(k),
                        "held_steps": last and last.held, "making_s": last and last.making_s,
                        "making_cpu_s": last and last.making_cpu_s})  # fmt: skip
        return out

    def summaries(self) -> list[tuple[RunSummary, dict[str, list[int]]]]:
        """The lanes' summaries: asked for now, or (`wait_for_figures` False) the last ones
        the lanes gave, with the next asked for in the background; the first call waits."""
        if self.wait_for_figures or self._summaries is None:
            self._summaries = [self.ask(k, "summary") for k in range(len(self.lanes))]
            return self._summaries
        with self._lock:  # a restart drops what was asked of a dead actor
            asking, lanes = self._asking, list(self.lanes)
        if asking is not None and all(lane.ready(a) for lane, a in zip(lanes, asking, strict=True)):
            with contextlib.suppress(Exception):  # a lane died: the last ones stand
                self._summaries = [lane.get(a) for lane, a in zip(lanes, asking, strict=True)]
            asking = None
        if asking is None:
            asking = [lane.call("summary") for lane in lanes]
        with self._lock:
            if self.lanes == lanes:
                self._asking = asking
        return self._summaries

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self.closed = True  # no lane is started again from here on
        for lane in self.lanes:
            lane.kill()

    def stop_reading(self) -> None:
        """Stop the lanes' reads and making, and keep the lanes (and the rows they hold) until
        `close`. A lane that dies from here on is not started again."""
        with self._lock:
            self.closed = True
        for lane in self.lanes:  # queued behind the chunks asked: not waited for
            with contextlib.suppress(Exception):  # a dead lane reads nothing
                lane.call("close")
