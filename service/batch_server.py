"""The batch server: the Ray actor that owns the feed and hands out batches.

Ray-free parts do the work, each unit-tested on its own:
- `window.StepWindow`: the world, retention (a step is held until every rank of the world has
  taken it) and flow control (at most `prefetch` steps ahead of the slowest live rank);
- `producer.Producer`: the deterministic StepFeed on a thread, one step at a time, into the window;
- `telemetry.Telemetry`: throughput history, data wait per rank, the rejects buffer;
- `autoscale.Autoscaler` (with `service.autoscale`): a thread that asks the cluster for CPUs
  while the ranks wait (the rule: `demand.Demand`).

Three parts of the class live in their own modules, each on top of the one before:
`server_view.ServerView` (status, metrics, the producer's state, a stall), `sequence.Sequencing`
(the step source built, installed, sought by a resume, changed by a skip, steps made
recomputed) and `ranks.RankDesk` (the rank protocol: hello, beats, long polls for rows, leave).

This class builds them (its constructor) under one condition variable and adds the operators'
control (new weights, pause, resume, stop, the owner's heartbeat) and the states the ranks and
the API save. Requests are long polls of at most `POLL_S` seconds (StepReply `wait`), so a
blocked rank holds a thread of the `consumers` group only briefly, the server notices a rank
that stopped asking, and the API (group `control`) always has threads of its own.

The actor is not detached: it lives as long as the process that started it (`tokenmill serve`,
or the Ray job), so a killed `serve` never leaves a service behind that blocks the next one.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from typing import TYPE_CHECKING

from service.losses import StreamLosses
from service.ranks import RankDesk
from wire.protocol import (
    LOOKAHEAD,
    STOPPING,
    WINDOW_BYTES,
    WINDOW_STEPS,
    StepGone,
)

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.feed import LeaveOut, StepSource

# The pipeline is imported where it is used, not here: a rank's `ray.get_actor` loads this
# class, so every rank imports this module too (with the pipeline and pydantic, that cost
# each rank ~0.37 CPU-s at connect, on the cores the service was starting on).


class _Default(enum.Enum):
    """A sentinel type: `rank_timeout_s` None means no timeout, so "not given" needs its own."""

    TOKEN = 0


_DEFAULT = _Default.TOKEN


def prefetch_window(cfg: Config) -> int:
    """The window's length in global steps: `service.prefetch`, else WINDOW_STEPS (32), or
    LOOKAHEAD (64) when the lanes hold the rows (`lanes` > 1), so that a hungry rank can take
    that many in one call; unless the window would then hold more than WINDOW_BYTES of token
    ids (a step of G x L int32: here, or in the lanes), and never fewer than 8."""
    if cfg.service.prefetch is not None:
        return cfg.service.prefetch
    step_bytes = cfg.global_batch_size * cfg.seq_len * 4
    steps = LOOKAHEAD if cfg.lanes > 1 else WINDOW_STEPS
    return max(8, min(steps, WINDOW_BYTES // step_bytes))


class BatchServer(RankDesk):
    def __init__(
        self,
        cfg_json: dict,
        state: dict | None = None,
        prefetch: int | None = None,
        keep_states: int = 10_000,
        rank_timeout_s: float | None | _Default = _DEFAULT,
        allow_config_change: bool = False,
        pool: bool = False,
        leave_out: LeaveOut | None = None,
    ):
        from pipeline.config import Config
        from pipeline.tokenize.engines import load_in_background

        self.cfg = Config.model_validate(cfg_json)
        # The tokenizer loads while the rest of the pipeline is imported and planned; the feed
        # finds it loaded or waits for it, and raises its error if it failed.
        load_in_background(self.cfg.tokenizer)
        from service.telemetry import Telemetry

        self.pool = pool  # tokenize on the warm pool (a running cluster), else Ray Data
        self.prefetch = max(1, prefetch or prefetch_window(self.cfg))
        self.keep_states = keep_states
        self.rank_timeout_s = (
            self.cfg.service.rank_timeout_s if rank_timeout_s is _DEFAULT else rank_timeout_s
        )
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # Hungry ranks linger here (get), woken only when the steps they wait for are made
        # (_on_step): on the shared condition, every step woke every lingering rank.
        self._lingering = threading.Condition(lock)
        self._linger_for: dict[int, int] = {}  # rank -> the step count (produced) it waits for
        self.telemetry = Telemetry()
        policy = self.cfg.mixing.policy
        # The policy reads windows up to every + delay steps back (and a state carries them).
        keep = 4096 if policy is None else max(4096, 2 * (policy.every + policy.delay))
        self.losses = StreamLosses(list(self.cfg.streams), keep=keep)
        self.steering = None
        if policy is not None:
            from service.steering import Steering

            self.steering = Steering(self.cfg, self.losses, self._cond)
        self._started = time.time()
        self._stop_requested = False
        self._stop_now = False  # `stop --now`: held steps are not delivered either
        self._owner: dict = {}
        self._seek_lock = threading.Lock()  # ranks resuming together restart the feed once
        self._seeked: dict | None = None
        self._hungry: dict[int, bool] = {}  # rank -> its last answer waited for the producer
        # Token rows this process has sent ranks, as Arrow IPC bytes, and the rank-steps they
        # held: with `lanes` > 1 none (the ranks take their rows from the lanes; metrics
        # `control_row_bytes`, bench/nodes.py), with `lanes: 1` every row.
        self._sent = [0, 0]
        self._sent_lock = threading.Lock()
        self._rank_jobs: dict[int, str] = {}  # rank -> its Ray job id (hello's `client`)
        self._observed: tuple[float, str] = (0.0, "")  # when and what `_observe` last kept
        self._replaying = threading.Lock()  # one provenance replay at a time (`provenance`)
        self._control = threading.Lock()  # one change of course at a time (`_controlled`)
        # Laned feeds a skip replaced, with the first step they did not make: their lanes
        # hold rows of the steps before it until every rank has fetched them.
        self._retired: list[tuple[int, StepSource]] = []
        self.demand = None
        self._scaler = None
        scale = self.cfg.service.autoscale
        if scale is not None:  # imported before the feed's Ray Data starts (coordinator_place)
            from service.autoscale import coordinator_place

            make_place = coordinator_place(f"tokenmill-{os.getpid()}-{id(self)}")
        self._start_feed(state, allow_config_change, leave_out)
        if scale is not None:  # after the feed: a refused state leaves no thread behind
            from service.autoscale import Autoscaler
            from service.demand import Demand

            self.demand = Demand(scale.max_cpus, scale.up_wait, scale.cooldown_s, scale.window_s)
            tel, window_s = self.telemetry, scale.window_s
            self._scaler = Autoscaler(
                self.demand,
                waits=lambda: {r: s for r, (s, _) in tel.wait_by_rank(window_s).items()},
                observed=lambda: [
                    (o["t"], o["producer"]) for o in tel.observations_view(last=3600)
                ],
                place=make_place,
            )

    # -- production -------------------------------------------------------------------------

    def _start_feed(self, state: dict | None, allow_config_change: bool = False,
                    leave_out: LeaveOut | None = None) -> None:  # fmt: skip
        carried = self._carried(state)
        feed = self._make_feed(state, allow_config_change, leave_out)
        self.losses.carry(carried, feed.step)
        self._install(feed)

    def state(self, step: int | None = None, wait_s: float | None = None) -> dict:
        """The state at `step` (default: the newest made; under the mixing policy, the newest
        whose carried loss is complete, as the ranks train behind the steps made). Under the
        policy it carries the loss its resume decides from, waited for: up to `wait_s` (the
        API's), else up to `mixing.policy.wait_s` (a rank's, at the step it is about to
        train)."""
        with self._cond:
            states = self.producer.states
            if step is None and self.steering is not None:
                step = next((s for s in reversed(states) if self.steering.complete(s)),
                            next(iter(states)))  # fmt: skip
            step = max(states) if step is None else step
            if step not in states:
                held = f"{next(iter(states))}..{max(states)}" if states else "none"
                raise StepGone(f"no state for step {step} (states held: {held})")
            kept = states[step]
            producer = self.producer
        state = kept.unpack()
        if self.steering is not None:  # with the loss its resume decides from
            return self.steering.attach(state, step, lambda: producer.stopping, wait_s)
        return state

    # -- control (concurrency group `control`) ------------------------------------------------

    def set_weights(self, weights: dict[str, float]) -> int:
        """New weights, effective at the first step whose production has not begun."""
        missing = sorted(set(self.cfg.streams) - set(weights))
        if missing:
            raise ValueError(
                f"weights must name every stream; missing: {', '.join(missing)} "
                f"(streams: {', '.join(self.cfg.streams)})"
            )
        with self._controlled(), self._cond:
            # The first step whose production has not begun; it changes only under this lock
            # (feed.step moves inside next_step, outside it), so concurrent calls agree and
            # the schedule never goes backwards, also across the end of the data.
            # Lanes confirm it as they come to it (`wait=False`); a StepFeed changes at once.
            step = self.feed.set_weights(weights, self.producer.first_open, wait=False)
            self._sample(force=True)
            return step

    def pause(self) -> str:
        with self._controlled():
            self.producer.set_paused(True)
        with self._cond:
            self._observe()
        return "paused"

    def resume(self) -> str:
        with self._controlled():
            self.producer.set_paused(False)
        with self._cond:
            self._observe()
        return "running"

    def heartbeat(self, owner: dict | None = None) -> None:
        """The `serve` process says it is alive (a service whose owner stopped beating is stale)."""
        self._owner = dict(owner or self._owner, beat=time.time())

    def request_stop(self, now: bool = False) -> str:
        """`tokenmill stop`: no step is made any more; each rank gets every step made before
        (none with `now`), then a clean end (`stopped`), and the owning `serve` exits once
        every rank has had its end (the drain; status `drained`)."""
        with self._cond:
            self._stop_requested = True
            self._stop_now = self._stop_now or now
            self.producer.set_paused(True)  # what is made is what the ranks get
            self._wake_all()
            self._observe()
        return STOPPING

    def drain_rejects(self) -> list[dict]:
        with self._cond:
            return self.telemetry.drain_rejects()

    def close(self) -> None:
        if self._scaler is not None:  # it withdraws its request as it ends
            self._scaler.close()
        self.producer.stop()
        for _, feed in self._retired:
            feed.close()
