"""Token-weighted mixing by deficit scheduling.

Every stream has a target share w_s of *tokens* (not samples). Each time n tokens of any
stream are placed into a row, every stream's target grows by w_s * n and the placing stream's
count grows by n. The next segment comes from the stream with the largest deficit
(target - placed), ties going to the stream listed first. No random draws: the schedule is a
pure function of the config, and the realized share of any stream at any prefix is within one
segment (at most one row, `seq_len` tokens) of its target. Sample-based mixers (Mosaic, Grain,
LitData) drift whenever documents of the streams differ in length; this one cannot.

Weights can change at a stated global step (a config `schedule:` or `set_weights` at run
time), never retroactively. The changes are kept in `history`, which is part of the resumable
state, so a resumed run replays the same schedule.

The history is bounded (unbounded, 5,259 weight PUTs made every `/v1/mixture` and every
state 450 KB). The weights in effect at step t come from the last change at a step <= t, so from
the current step on only the change in effect now and the changes scheduled after it can
ever be chosen again. The history keeps exactly those, which makes resume exact, plus:

- a change at the same step as the last one replaces it (the later one was the one in
  effect anyway: concurrent PUTs before a step begins leave one entry, not one each);
- of the changes that no longer matter, the `HISTORY_PAST` most recent, for the record;
  older ones are dropped and counted (`history_dropped`, in the state only once nonzero, so
  states of runs that never drop one are unchanged);
- at most `HISTORY_PENDING` changes may be scheduled ahead of the current step (a
  ValueError past that).

So a history holds at most HISTORY_PAST + 1 + HISTORY_PENDING changes, ~50 bytes per stream
each; with one `set_weights` per step (the API schedules at the next open step) it stays
at HISTORY_PAST + 2.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.config import normalize_weights


@dataclass(frozen=True)
class WeightChange:
    step: int
    weights: dict[str, float]
    source: str  # "config", "schedule", "api", "resume", "policy" (mixing.policy)

    def as_dict(self) -> dict:
        return {"step": self.step, "weights": self.weights, "source": self.source}


# DeficitMixer state keys; per-stream values are keyed by stream name
HISTORY = "history"
TARGET = "target"
PLACED = "placed"
ALIVE = "alive"
WEIGHTS = "weights"
STEP = "step"
STOPPED = "stopped"
EXHAUSTED = "exhausted"
HISTORY_DROPPED = "history_dropped"  # changes dropped from the history's past (absent: 0)

# Changes kept that no longer affect any step to come, for the record; at least 1, as the
# summary and the server ask for the weights of the step before the current one.
HISTORY_PAST = 16
HISTORY_PENDING = 1024  # changes that may be scheduled ahead of the current step


class DeficitMixer:
    """Chooses which stream supplies the next segment; tracks targets and realized tokens.

    It also owns what happens when a stream runs out (`on_exhausted`): `stop` ends the run,
    `renormalize` shares the exhausted stream's weight among the others. Either is recorded
    in `exhausted_log`.
    """

    def __init__(self, names: list[str], weights: Mapping[str, float], on_exhausted: str = "stop"):
        self.names = list(names)
        self.on_exhausted = on_exhausted
        self.history: list[WeightChange] = []
        self.history_dropped = 0  # changes dropped from the history (module docstring)
        self._step = 0
        self._add(0, weights, "config")
        self.target = np.zeros(len(names), dtype=np.float64)
        self.placed = np.zeros(len(names), dtype=np.int64)
        self.alive = np.ones(len(names), dtype=bool)
        self.stopped = False  # a stream ran out under on_exhausted=stop (or all did)
        self.exhausted_log: list[str] = []
        # `_weights_for`'s last answer: (the change in effect, `alive` as bytes, the weights)
        self._memo: tuple[WeightChange, bytes, np.ndarray] | None = None
        self._w = self._weights_for(0)

    def _add(self, step: int, weights: Mapping[str, float], source: str) -> int:
        normalize_weights(weights, self.names)  # validates
        change = WeightChange(step, {k: float(v) for k, v in weights.items()}, source)
        # In step order: a change may come before one scheduled later (a config `schedule:`
        # entry ahead, and the API or the mixing policy now); the later one still takes
        # over at its step.
        at = bisect.bisect_right([c.step for c in self.history], step)
        if at and self.history[at - 1].step == step:
            self.history[at - 1] = change  # the earlier change at this step is never in effect
            self.history_dropped += 1
            return step
        pending = sum(1 for c in self.history if c.step > self._step)
        if pending >= HISTORY_PENDING:
            raise ValueError(
                f"{pending} weight changes are already scheduled after step {self._step}; "
                f"at most {HISTORY_PENDING} may wait (change weights nearer their step)"
            )
        self.history.insert(at, change)
        return step

    def schedule(self, step: int, weights: Mapping[str, float], source: str = "api") -> int:
        """Record new weights effective from global `step` (>= the current step)."""
        if step < self._step:
            raise ValueError(f"effective step {step} is in the past (current step {self._step})")
        self._add(step, weights, source)
        return step

    def _in_effect(self, step: int) -> WeightChange:
        current = None
        for change in self.history:
            if change.step <= step:
                current = change
        assert current is not None  # history[0] is the config's weights, at step 0
        return current

    def scheduled_weights(self, step: int) -> np.ndarray:
        """The normalized weights in effect at `step`, before exhausted streams are removed."""
        return self._scheduled(self._in_effect(step))

    def _scheduled(self, change: WeightChange) -> np.ndarray:
        # Before a resume that added or removed streams, the history names other streams.
        known = {k: v for k, v in change.weights.items() if k in self.names}
        if not any(known.values()):
            return np.zeros(len(self.names), dtype=np.float64)
        return normalize_weights(known, self.names)

    def _weights_for(self, step: int) -> np.ndarray:
        """The weights at `step`, less exhausted streams'. Every step begins with them (a lane
        of 16 begins ~1,000 steps a second), and they change only with the change in effect
        or a stream's end: the last answer is kept for that pair."""
        change, alive = self._in_effect(step), self.alive.tobytes()
        memo = self._memo
        if memo is not None and memo[0] is change and memo[1] == alive:
            return memo[2]
        w = self._scheduled(change) * self.alive
        if w.sum() > 0:
            w = w / w.sum()
        w.flags.writeable = False  # shared by the steps that keep it
        self._memo = (change, alive, w)
        return w

    def begin_step(self, step: int) -> None:
        self._step = step
        self._trim_history(step)
        self._set(self._weights_for(step))

    def _trim_history(self, step: int) -> None:
        """Drop the oldest changes that can no longer be in effect at `step` or after (those
        before the one in effect at `step`), beyond the `HISTORY_PAST` most recent of them."""
        current = 0
        while current + 1 < len(self.history) and self.history[current + 1].step <= step:
            current += 1
        extra = current - HISTORY_PAST
        if extra > 0:
            del self.history[:extra]
            self.history_dropped += extra

    def _set(self, w: np.ndarray) -> None:
        """Adopt new weights. Deficits restart at zero, so the realized share from this
        point on tracks the new target within one row (old shortfalls are not repaid)."""
        if not np.array_equal(w, self._w):
            self.target = self.placed.astype(np.float64)
        self._w = w

    @property
    def weights(self) -> np.ndarray:
        return self._w

    def exhausted(self, stream: int) -> None:
        """Stream `stream` has nothing left: stop the run or renormalize, per `on_exhausted`.
        The others' weights are renormalized from the current step on either way."""
        if not self.alive[stream]:
            return
        name = self.names[stream]
        others = [i for i in range(len(self.names)) if i != stream and self.alive[i]]
        if self.on_exhausted == "stop" or not others:
            self.stopped = True
            self.exhausted_log.append(f"stream {name!r} exhausted: stopping the run")
        else:
            self.exhausted_log.append(f"stream {name!r} exhausted: renormalizing the others")
        self.alive[stream] = False
        self._set(self._weights_for(self._step))

    def pick(self, candidates: Iterable[int]) -> int | None:
        """The candidate furthest behind its target; None when no candidate has weight > 0."""
        best, best_deficit = None, -math.inf
        deficit = self.target - self.placed
        for s in candidates:
            if self._w[s] <= 0:
                continue
            if deficit[s] > best_deficit:
                best, best_deficit = s, deficit[s]
        return best

    def quota(self, stream: int, bound: float) -> int:
        """The most tokens `stream` can take now with every stream staying within `bound`
        tokens of its target (at least 1). Concat packing cuts pieces to this, so its error
        is within one row at every prefix, not only on average: taking whole pieces of up to
        a row, the greedy choice alone overshot by up to 11% of a row (found by hypothesis).
        """
        d = self.target - self.placed
        w = self._w
        limits = [math.inf]
        if w[stream] < 1:
            limits.append((d[stream] + bound) / (1 - w[stream]))
        for j in range(len(w)):
            if j != stream and w[j] > 0:
                limits.append((bound - d[j]) / w[j])
        most = min(limits)
        return max(1, math.floor(most - 1e-9)) if math.isfinite(most) else 1 << 62

    def place(self, stream: int, n: int) -> None:
        self.placed[stream] += n
        self.target += self._w * n

    def get_state(self) -> dict:
        def by_name(values) -> dict:
            return dict(zip(self.names, values.tolist(), strict=True))

        state = {
            HISTORY: [c.as_dict() for c in self.history],
            TARGET: by_name(self.target),
            PLACED: by_name(self.placed),
            ALIVE: by_name(self.alive),
            WEIGHTS: by_name(self._w),
            STEP: self._step,
            STOPPED: self.stopped,
            EXHAUSTED: list(self.exhausted_log),
        }
        if self.history_dropped:  # absent while 0: the states of earlier versions' runs
            state[HISTORY_DROPPED] = self.history_dropped
        return state

    def set_state(self, state: dict) -> None:
        """Streams the state does not name (added at a resume) start at zero; streams it
        names that are not here (removed) are left out."""
        self.history = [WeightChange(**c) for c in state[HISTORY]]
        self.history_dropped = int(state.get(HISTORY_DROPPED, 0))
        for attr, key, default in (("target", TARGET, 0.0), ("placed", PLACED, 0),
                                   ("alive", ALIVE, True), ("_w", WEIGHTS, 0.0)):  # fmt: skip
            old = getattr(self, attr)
            values = [state[key].get(n, default) for n in self.names]
            setattr(self, attr, np.array(values, dtype=old.dtype))
        self._step = int(state[STEP])
        self.stopped = bool(state[STOPPED])
        self.exhausted_log = list(state[EXHAUSTED])

    def realized(self) -> dict[str, float]:
        total = self.placed.sum()
        return {
            n: (float(self.placed[i] / total) if total else 0.0) for i, n in enumerate(self.names)
        }
