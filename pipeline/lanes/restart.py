"""What a laned feed keeps to start a dead lane again from its state, and what it asks the
new actor, in order (`Restarts`; lanes/group.py `LaneGroup.restart` starts the actor).

A holding lane (the batch server's) whose process died, killed or with its node, is started
again from its kept state at the oldest step it still held: every rank had the steps before.
The new actor takes the weight changes that state does not hold and makes again, in order,
every step asked of the dead one since: those handed out and held for the ranks, then each
chunk asked and not yet joined. The sequence is a function of the state, so it makes the same
steps; it checks each state it reaches against the one the dead lane gave for that step
(LaneWorker `expect`), and holds a step for the ranks only if they are the same.

Order matters: a lane's state holds the weight changes scheduled ahead of it, so each change
is sent again after the steps that were asked before it was sent. Sent all first, the remade
states differ, though the rows are the same.

Why from the state, not Ray's own actor restart (`max_restarts`): Ray runs the constructor
again with its first arguments, so the lane would make the whole run again from where the
service started before it reached the steps the ranks need."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from pipeline.state.resume import PACKER, Kept


@dataclass
class Sent:
    """A weight change sent to the lanes (`LanedFeed.set_weights`): after the steps asked
    before `asked` and before the others, its step, weights and source, and each lane's call
    (a restarted lane's replaced in place)."""

    asked: int
    step: int
    weights: dict
    source: str
    calls: list

    def change(self) -> dict:
        """As a lane's state records it (stages/mixing.py WeightChange)."""
        weights = {k: float(v) for k, v in self.weights.items()}
        return {"step": self.step, "weights": weights, "source": self.source}


class Restarts:
    """A laned feed's memory for restarts, up to `limit` a lane (`service.lane_restarts`; 0:
    none, nothing kept), and the log of those made. Guarded by the feed's lock.

    - `kept`: each lane's kept state at every step from the oldest a lane still holds (the
      `Kept` objects the feed's producer keeps anyway), pruned as the ranks take their steps
      (`forget_below`);
    - `sent`: the weight changes sent since the oldest kept step;
    - `remade`: the calls of steps made again whose answers are yet to be checked, each with
      its lane and actor;
    - `log`: each restart, its lane, the step it started again from, the steps asked again,
      the reason, the time and the how-manieth of that lane (metrics `lanes_restarted`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept: collections.OrderedDict[int, list[Kept]] = collections.OrderedDict()
        self.sent: list[Sent] = []
        self.remade: list[tuple[int, Any, Any]] = []
        self.log: list[dict] = []

    def count(self, k: int) -> int:
        """How many times lane k was started again."""
        return sum(1 for r in self.log if r["lane"] == k)

    def keep(self, step: int, states: list[Kept]) -> None:
        """The lanes' states at `step` (each before making it)."""
        if self.limit:
            self.kept[step] = states

    def note(self, sent: Sent) -> None:
        if self.limit:
            self.sent.append(sent)

    def forget_below(self, below: int) -> None:
        """Every rank has the steps before `below`: no lane makes them again."""
        while self.kept and next(iter(self.kept)) < below:
            self.kept.popitem(last=False)
        oldest = next(iter(self.kept), below)
        # A change sent before the oldest kept step's was made is in every kept state.
        self.sent = [sent for sent in self.sent if sent.asked >= oldest]

    def can_restart(self, k: int) -> bool:
        return self.count(k) < self.limit and bool(self.kept)

    def start_of(self, k: int) -> tuple[int, dict, dict[int, str]]:
        """Where lane k starts again: the oldest kept step, its state there, and the digest of
        the state it gave after each step it is to make again (LaneWorker `expect`)."""
        step, states = next(iter(self.kept.items()))
        expect = {at: kept[k].digest for at, kept in self.kept.items() if at > step}
        return step, states[k].unpack(), expect

    def ask_again(self, k: int, new: Any, step: int, state: dict, chunks: list, asked: int,
                  per_call: int, state_every: int, changes: list[tuple[int, list]]
                  ) -> None:  # fmt: skip
        """Asks `new` (lane k's new actor, an ActorLane, started from `state` at `step`) what
        was asked of lane k since, in the same order: the weight changes the state does not
        hold, each after the steps asked before it was sent, and the steps, `per_call` at a
        time, those joined already (to `remade`, checked as they come), then `chunks`, those
        not yet joined (their calls replaced in place). `asked`: the first step no lane has
        begun; `changes`: weight changes set without waiting, yet to be confirmed (a change
        the state holds already is answered here)."""
        import ray

        held = state[PACKER]["mixer"]["history"]
        pending = collections.deque(
            sent for sent in self.sent if sent.asked >= step and sent.change() not in held
        )
        replaced: set[int] = set()

        def changes_until(at: int | float) -> None:
            while pending and pending[0].asked <= at:
                sent = pending.popleft()
                sent.calls[k] = new.call("set_weights", sent.weights, sent.step, sent.source)
                replaced.add(id(sent.calls))

        end = chunks[0].first if chunks else asked
        first = step
        while first < end:
            changes_until(first)
            upto = min([first + per_call, end, *(c.asked for c in pending if c.asked > first)])
            # Joined already: the dead lane wrote their files (an export's) whole, and the
            # export may be taking them; only the chunks not yet joined write theirs again.
            self.remade.append((k, new, new.call("steps", upto - first, state_every, None, False)))
            first = upto
        for c in chunks:
            changes_until(c.first)
            c.calls[k] = new.call("steps", c.n, state_every, None)
        changes_until(float("inf"))
        for change_step, calls in changes:  # held by the state: answered here
            if id(calls) not in replaced:
                calls[k] = ray.put(change_step)

    def logged(self, k: int, step: int, steps: int, reason: str) -> int:
        """A restart of lane k from `step`, `steps` asked again: its how-manieth."""
        nth = self.count(k) + 1
        self.log.append({"lane": k, "step": step, "steps": steps, "reason": reason,
                         "at": time.time(), "restart": nth})  # fmt: skip
        return nth
