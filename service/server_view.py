"""What the batch server shows of itself: the producer's state, a stall, `GET /v1/status`,
`/v1/metrics` and the mixture.

`producer_state`, `why_waiting` and `stall` are pure functions of what they are handed
(tests/test_server_view.py). `ServerView` is the part of the batch server
(service/batch_server.py) that reads them out: every method takes the server's lock and
changes nothing but the telemetry's once-a-second observation.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wire.protocol import (
    FAILED,
    FINISHED,
    LOOKAHEAD,
    PRODUCER_ENDED,
    PRODUCER_FAILED,
    PRODUCER_MAKING,
    PRODUCER_PAUSED,
    PRODUCER_STARTING,
    PRODUCER_STOPPING,
    PRODUCER_WAITING_LOSS,
    PRODUCER_WINDOW_FULL,
    STARTING,
    STOPPING,
)

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.feed import StepSource
    from service.demand import Demand
    from service.losses import StreamLosses
    from service.producer import Producer
    from service.steering import Steering
    from service.telemetry import Telemetry
    from service.window import StepWindow

# A rank's current wait for data is named a stall (status and metrics `stall`) from this long.
STALL_S = 5.0
# Past this many ranks, the lag history keeps min / median / max, not every rank's lag (an hour
# of one-second samples of 1,024 ranks held ~220 MB and took 0.4 s to serve under the lock).
OBSERVED_RANKS = 64


def producer_state(
    state: str, *, stopping: bool, paused: bool, busy: bool, waiting_loss: bool, room: bool
) -> str:
    """What the producer does now: `making` a step, `window_full` (every rank has `prefetch`
    steps unconsumed ahead of it: the normal state of a data plane faster than its trainer),
    `paused`, `ended`, `failed`, `stopping`, `starting`, or `waiting_for_loss` (the mixing
    policy waits for the ranks' loss). `state` is the producer's own (wire.protocol)."""
    if stopping:
        return PRODUCER_STOPPING
    if state == FAILED:
        return PRODUCER_FAILED
    if state == FINISHED:
        return PRODUCER_ENDED
    if paused:
        return PRODUCER_PAUSED
    if waiting_loss:
        return PRODUCER_WAITING_LOSS
    if state == STARTING and not busy:
        return PRODUCER_STARTING
    if not busy and not room:
        return PRODUCER_WINDOW_FULL
    return PRODUCER_MAKING


def why_waiting(
    ranks: Callable[[], dict[int, dict]],
    *,
    paused: bool,
    policy_waits: tuple[int, int] | None,
    producing: bool,
    floor: int,
    prefetch: int,
) -> str:
    """Why a rank that asks for a step not made yet waits (a `wait` reply's reason, a stall's):
    `producing` is the producer at work or with room in the window; else the ranks standing
    at the window's `floor` hold it full (`ranks`: the window's `rank_view`, asked only then:
    it is O(world))."""
    if paused:
        return "paused"
    if policy_waits is not None:
        lo, hi = policy_waits
        return f"the mixing policy waits for every rank's loss of steps {lo}-{hi - 1}"
    if producing:
        return "producing"
    slow = [r for r, v in ranks().items() if not v["lost"] and v["next_step"] == floor]
    return f"waiting for rank(s) {slow} (prefetch window of {prefetch} steps is full)"


def stall(ranks: dict[int, dict], why: Callable[[], str]) -> dict:
    """The ranks waiting now for steps not made yet (`rank_view`'s `waiting_s`), for how long,
    and a stall named once one has waited STALL_S (`ranks [0, 1] waiting 46 s: paused`)."""
    waiting = {r: v["waiting_s"] for r, v in ranks.items()
               if v["waiting_s"] is not None and not (v["lost"] or v["left"])}  # fmt: skip
    worst = max(waiting.values(), default=0.0)
    named = None
    if worst >= STALL_S:
        named = f"ranks {sorted(waiting)} waiting {worst:.0f} s: {why()}"
    return {"ranks_waiting_s": {str(r): w for r, w in waiting.items()}, "stall": named}


class ServerView:
    """The batch server's read-outs, under its lock (`_cond`). The attributes are the server's
    (service/batch_server.py `BatchServer.__init__`)."""

    cfg: Config
    feed: StepSource
    window: StepWindow
    producer: Producer
    telemetry: Telemetry
    losses: StreamLosses
    steering: Steering | None
    demand: Demand | None
    prefetch: int
    _cond: threading.Condition
    _stop_requested: bool
    _started: float
    _owner: dict
    _observed: tuple[float, str]
    _sent: list[int]

    def _ended(self) -> bool:
        """No step will be made any more: the data ended, or a stop was asked."""
        return self.producer.ended or self._stop_requested

    def producer_state(self) -> str:
        """What the producer does now (under the lock): see `producer_state` above."""
        p = self.producer
        waiting_loss = self.steering is not None and self.steering.waiting is not None
        return producer_state(p.state, stopping=self._stop_requested, paused=p.paused,
                              busy=p.busy, waiting_loss=waiting_loss,
                              room=self.window.room())  # fmt: skip

    def _why_waiting(self) -> str:
        return why_waiting(
            self.window.rank_view,
            paused=self.producer.paused,
            policy_waits=None if self.steering is None else self.steering.waiting,
            producing=self.window.room() or self.producer.busy,
            floor=self.window.floor(),
            prefetch=self.prefetch,
        )

    def _stall(self, ranks: dict[int, dict]) -> dict:
        return stall(ranks, self._why_waiting)

    def _observe(self) -> None:
        """Under the lock: the producer's state and each rank's lag into telemetry, once a
        second or at once when the state changes (`rank_view` is O(world): not every step)."""
        state, now = self.producer_state(), time.monotonic()
        if state == self._observed[1] and now - self._observed[0] < 1.0:
            return
        self._observed = (now, state)
        lags: dict = {r: v["lag"] for r, v in self.window.rank_view().items()}
        if len(lags) > OBSERVED_RANKS:  # an hour of a large world's lags: kept as a summary
            ordered = sorted(lags.values())
            lags = {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}
        self.telemetry.observe(state, lags)

    def _sample(self, force: bool) -> None:
        if not self.telemetry.due(force):  # every step calls; one a second is kept
            return
        m = self.feed.mixer
        targets = dict(zip(m.names, m.scheduled_weights(max(self.feed.step - 1, 0)).tolist(), strict=True))  # fmt: skip
        self.telemetry.sample(self.feed.real_tokens, self.feed.rows, m.realized(), targets, force)

    def mixture(self) -> dict:
        with self._cond:
            m = self.feed.mixer
            return {
                "weights": dict(
                    zip(m.names, m.scheduled_weights(self.feed.step).tolist(), strict=True)
                ),  # fmt: skip
                "realized": m.realized(),
                "history": [c.as_dict() for c in m.history],
                "step": self.feed.step,
            }

    def status(self) -> dict:
        with self._cond:
            ranks = self.window.rank_view()
            beat = self._owner.get("beat")
            return {
                "state": STOPPING if self._stop_requested else self.producer.state,
                "producer": self.producer_state(),
                "drained": self._ended() and self.window.drained(self._stop_requested),
                "error": self.producer.error,
                "streams": list(self.cfg.streams),
                "world_size": self.window.world,
                "ranks_connected": sum(r["connected"] for r in ranks.values()),
                "lost_ranks": [r for r, v in ranks.items() if v["lost"]],
                "left_ranks": [r for r, v in ranks.items() if v.get("left")],
                # connected ranks not yet told the end (what a drain waits for)
                "ranks_to_end": [
                    r
                    for r, v in ranks.items()
                    if v["connected"] and not (v["ended"] or v["lost"] or v["left"])
                ],
                **self._stall(ranks),
                "global_step": self.window.produced,
                "first_step": self.window.start,
                "uptime_s": time.time() - self._started,
                "config_hash": self.feed.config_hash,
                "owner": {k: v for k, v in self._owner.items() if k != "beat"},
                "owner_beat_s_ago": None if beat is None else time.time() - beat,
                "server": {"pid": os.getpid(), "host": socket.gethostname()},
                "autoscale": None if self.demand is None else self.demand.view(),
            }

    def metrics(self) -> dict:
        with self._cond:
            self._observe()
            s = self.feed.summary()
            tel = self.telemetry
            tok_rate, row_rate = tel.rates()
            ranks: dict[int, dict[str, Any]] = self.window.rank_view()
            waits = tel.wait_by_rank()
            # What the trainers consume (their beats' steps a second, each rank's G/W rows of
            # seq_len at the run's packing efficiency): real tokens, beside what is made.
            W = self.window.world or 1
            per_step = self.cfg.global_batch_size / W * self.cfg.seq_len * s.packing_efficiency
            consumed = 0.0
            for r, v in ranks.items():
                v["wait_s_last_60s"], v["waits"] = waits.get(r, (0.0, 0))
                rate = v["consumed_steps_per_s"]
                v["consumed_tokens_per_s"] = None if rate is None else rate * per_step
                consumed += v["consumed_tokens_per_s"] or 0.0
            all_waits = list(waits.values())
            return {
                "tokens_per_s": tok_rate,
                "consumed_tokens_per_s": consumed,
                **self._stall(ranks),
                "batches_per_s": row_rate / self.cfg.global_batch_size,
                "producer": self.producer_state(),
                "lag_normal_max": self.prefetch + min(LOOKAHEAD, self.prefetch),
                "global_step": self.window.produced,
                "held_steps": len(self.window.steps),
                # `lanes` > 1: where each lane runs and the steps it holds (LaneGroup.view)
                "lanes": self.feed.lane_view(),
                "lanes_waited_s": self.feed.waited_s,  # producer, on lanes
                "lanes_chunks_ahead": self.feed.depth,  # LanedFeed.depth
                # lanes started again after their process died (LaneGroup.restart)
                "lanes_restarted": list(self.feed.restarted),
                "prefetch": self.prefetch,
                # Row bytes that passed through this (the control) process to ranks, and the
                # rank-steps they held: 0 with `lanes` > 1, where ranks pull from the lanes.
                "control_row_bytes": self._sent[0],
                "control_rank_steps": self._sent[1],
                "real_tokens": s.real_tokens,
                "rows": s.rows,
                "packing_efficiency": s.packing_efficiency,
                "streams": {name: st.as_dict() for name, st in s.streams.items()},
                "tokenizer_backend": s.tokenizer_backend,
                "world_size": self.window.world,
                "ranks": {str(r): v for r, v in ranks.items()},
                "queue_depth": {str(r): v["lag"] for r, v in ranks.items()},
                "data_wait_s_last_60s": sum(w for w, _ in all_waits),
                "data_wait_reports": sum(n for _, n in all_waits),
                "rejects": tel.rejects_total,
                "rejects_unlisted": tel.rejects_unlisted,
                "mixture_history": s.mixture_history,
                "history": tel.history_view(),
                "observations": tel.observations_view(),
                "stream_loss": self.losses.view(),
                "left_out": s.left_out,  # documents a resume left out (--skip-steps, --skip-docs)
                "policy": None if self.steering is None else self.steering.view(),
            }
