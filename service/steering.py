"""The mixing policy in the service: waits for a window's loss, decides, carries what a resume
needs. Ray-free. The rule itself is pipeline/stages/policy.py.

Owner: the server's condition variable (`cond`) guards `waiting`, `decisions` and the wait;
the producer thread calls `gate`, a control thread `attach`, any thread `reported`.

- `gate(feed, step, stopped)`: the producer calls it before it makes `step`. Where a decision
  takes effect there, it waits until every rank has reported every step of the decision's
  window (StreamLosses.mean), then schedules the weights at `step` through the feed's audited
  weight path (source "policy"). A window that stays incomplete for `wait_s` fails the
  producer with an error naming the steps and the ranks that did report them: a trainer that
  never reports its loss gets told, instead of a service that waits forever.
- `attach(state, step, ended)`: the state handed to a rank at `step`, with the loss of the
  steps before `step` that later decisions read (pipeline/stages/policy.py `LOSSES`), waited
  for the same way: a rank asks for the state of the step it is about to train, so it has
  reported the steps before it, and the other ranks of a synchronous trainer have too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from pipeline.config import Config
from pipeline.stages.policy import (
    LOSSES,
    SOURCE,
    decide,
    needed_steps,
    window_for,
    windows_after,
)
from pipeline.state.resume import seal
from service.losses import StreamLosses
from wire.protocol import ServiceBusy, StepGone

DECISIONS_KEPT = 256  # recent decisions in /v1/metrics (the weights are in the history too)


class PolicyStalled(RuntimeError):
    """A window's loss did not come within `mixing.policy.wait_s`."""


class Steering:
    def __init__(self, cfg: Config, losses: StreamLosses, cond: threading.Condition):
        assert cfg.mixing.policy is not None
        self.policy = cfg.mixing.policy
        self.base = cfg.weights
        self.losses = losses
        self.cond = cond
        self.waiting: tuple[int, int] | None = None  # the window the producer waits for
        self._waiters = 0  # threads in `_wait` (`reported` wakes them)
        self.decisions: deque[dict] = deque(maxlen=DECISIONS_KEPT)

    def view(self) -> dict:
        """For /v1/metrics: the policy, what it waits for, its recent decisions."""
        with self.cond:
            return {"every": self.policy.every, "delay": self.policy.delay,
                    "eta": self.policy.eta, "smoothing": self.policy.smoothing,
                    "waiting_for_steps": None if self.waiting is None else list(self.waiting),
                    "decisions": list(self.decisions)}  # fmt: skip

    def reported(self) -> None:
        """A rank reported a step's loss: wake whoever waits for a window."""
        if self._waiters:
            with self.cond:
                self.cond.notify_all()

    def _wait(self, lo: int, hi: int, stopped: Callable[[], bool], producer: bool,
              wait_s: float | None = None):  # fmt: skip
        """The mean loss of steps [lo, hi) once complete; None if `stopped()` first;
        PolicyStalled after `wait_s` (default: the policy's)."""
        start = time.monotonic()
        deadline = start + (self.policy.wait_s if wait_s is None else wait_s)
        with self.cond:
            self._waiters += 1
            try:
                while (means := self.losses.mean(lo, hi)) is None:
                    if stopped():
                        return None
                    if time.monotonic() > deadline:
                        missing = self.losses.missing(lo, hi)
                        first = min(missing)
                        raise PolicyStalled(
                            f"mixing.policy: the loss of steps {lo}-{hi - 1} is not complete "
                            f"after {deadline - start:g} s ({len(missing)} step(s) missing; "
                            f"step {first} was reported by rank(s) {missing[first]} of world "
                            f"{self.losses.world}): every rank must report each step's loss "
                            "(Feed.report_loss(step, trainer.feed.stream_loss(batch, loss)))"
                        )
                    if producer:
                        self.waiting = (lo, hi)
                    self.cond.wait(timeout=1.0)
            finally:
                self._waiters -= 1
                if producer:
                    self.waiting = None
        return means

    def gate(self, feed, step: int, stopped: Callable[[], bool]) -> bool:
        """Before `step` is made: decide its weights if a decision takes effect there (waiting
        for its window's loss). True if the weights were scheduled.

        The update starts from the weights in effect at `step`, an API change scheduled at
        the same step included (the policy's weights then replace it in the history)."""
        window = window_for(step, self.policy.every, self.policy.delay)
        if window is None:
            return False
        means = self._wait(*window, stopped, producer=True)
        if means is None:
            return False
        with self.cond:
            m = feed.mixer
            if any(c.step == step and c.source == SOURCE for c in m.history):
                return False  # decided already: a resume from the state kept after deciding
            current = dict(zip(m.names, m.scheduled_weights(step).tolist(), strict=True))
            weights = decide(self.policy, current, self.base, means)
            feed.set_weights(weights, step, source=SOURCE)
            self.decisions.append({"step": step, "window": list(window), "loss": means,
                                   "weights": weights})  # fmt: skip
        return True

    def complete(self, step: int) -> bool:
        """Whether the loss a state at `step` carries is all reported (`attach` would not
        wait)."""
        return all(self.losses.sums(s) is not None
                   for s in needed_steps(step, self.policy.every, self.policy.delay))  # fmt: skip

    def forget_after(self, step: int) -> None:
        """A resume at `step`: the decisions from it on are of the sequence left behind."""
        with self.cond:
            kept = [d for d in self.decisions if d["step"] < step]
            self.decisions.clear()
            self.decisions.extend(kept)

    def attach(self, state: dict, step: int, stopped: Callable[[], bool],
               wait_s: float | None = None) -> dict:  # fmt: skip
        """`state` (the state at `step`) with the loss of the steps before `step` that the
        decisions at `step` or later read, sealed again. Waits for them, up to `wait_s`
        (default the policy's): the API asks for any step, also one the ranks have not
        trained; a rank asks within its call's timeout. ServiceBusy once that is over, and
        StepGone if the sequence is replaced meanwhile: never a state without them."""
        carried: dict[str, dict] = {}
        for lo, hi in windows_after(step, self.policy.every, self.policy.delay):
            hi = min(hi, step)
            try:
                means = self._wait(lo, hi, stopped, producer=False, wait_s=wait_s)
            except PolicyStalled as e:
                raise ServiceBusy(
                    f"the state at step {step} carries the loss of steps {lo}-{hi - 1} for the "
                    f"mixing policy, not all reported yet ({e}); a state of a step every rank "
                    "has trained and reported is complete (ranks train behind the steps made)"
                ) from None
            if means is None:  # never a state without the loss its resume decides from
                raise StepGone(
                    f"the service restarted its sequence while the state at step {step} "
                    "waited for the loss it carries"
                )
            for s in range(lo, hi):
                sums = self.losses.sums(s)
                assert sums is not None  # complete: _wait saw it, and a complete step stays
                carried[str(s)] = sums
        if not carried:
            return state
        return seal({**state, LOSSES: carried})
