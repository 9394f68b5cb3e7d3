"""Loss per stream, as the trainer ranks report it. Ray-free.

A rank reports, for a global step it trained on, each stream's summed loss and labelled
tokens (`trainer.feed.stream_loss`, one call). Steps are joined over ranks: a step is complete
once every rank of the world has reported it. What is kept is bounded: the last `keep` steps.

Owner: a StreamLosses guards itself with its own lock; any thread may call any method.

What it answers:
- `view()`: per stream, the token-weighted mean loss over the last `window` complete steps
  (and its tokens), for `/v1/metrics`, Prometheus and the page; and a per-step history;
- `mean(lo, hi)`: per stream, the token-weighted mean over steps [lo, hi), or None unless
  every step there is complete: what the mixing policy decides from (pipeline/stages/policy.py),
  so that its decision is a function of the reports, never of when they arrived;
- `sums(step)`: one complete step's sums, which the policy carries in a state it hands out.

Steps reported before a resume come with the resume's state (`carry`): they count as complete,
whatever the world now, and take precedence over any report of the same step.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping


class StreamLosses:
    def __init__(self, streams: list[str], keep: int = 4096, window: int = 50):
        self.streams = list(streams)
        self.keep = keep
        self.window = window
        self._lock = threading.Lock()
        # step -> (ranks reported, {stream: [loss sum, tokens]})
        self._steps: OrderedDict[int, tuple[set[int], dict[str, list[float]]]] = OrderedDict()
        self.world: int | None = None
        self.reports = 0
        self._carried: dict[int, dict[str, list[float]]] = {}  # a resume's earlier steps

    def carry(self, steps: Mapping[int, Mapping[str, list[float]]], start: int) -> None:
        """A resume at step `start`: the complete sums of steps before it that its state
        carried, and no report of a step from `start` on (a rewound service's earlier reports
        of those steps are of another run: the ranks report them again)."""
        with self._lock:
            self._carried = {int(k): {n: list(v) for n, v in s.items()} for k, s in steps.items()}
            for step in [s for s in self._steps if s >= start]:
                del self._steps[step]

    def joined_without_state(self, rank: int, world: int, before: int, span: int) -> None:
        """Rank `rank` of `world` joined at step `before` without a state (a trainer that
        takes over where the service is): it reports no step before `before`, so for the
        `span` steps before it, it counts as having reported nothing. Else a step that a
        stopped run fetched and never trained would wait for its report for ever."""
        with self._lock:
            if world != self.world:
                self.world = world
                self._steps.clear()
            for step in range(max(0, before - span), before):
                if step not in self._carried:
                    self._steps.setdefault(step, (set(), {}))[0].add(rank)
            while len(self._steps) > self.keep:
                self._steps.popitem(last=False)

    def _step(self, step: int) -> dict[str, list[float]] | None:  # under the lock
        if step in self._carried:
            return self._carried[step]
        got = self._steps.get(step)
        if got is None or not self.world or len(got[0]) < self.world:
            return None
        return got[1]

    def sums(self, step: int) -> dict[str, list[float]] | None:
        """Step `step`'s {stream: [loss sum, tokens]} over the world, once complete; else None."""
        with self._lock:
            got = self._step(step)
            return None if got is None else {n: list(v) for n, v in got.items()}

    def missing(self, lo: int, hi: int) -> dict[int, list[int]]:
        """The incomplete steps of [lo, hi) and, for each, the ranks that reported it."""
        with self._lock:
            return {s: sorted(self._steps[s][0]) if s in self._steps else []
                    for s in range(lo, hi) if self._step(s) is None}  # fmt: skip

    def add(self, rank: int, world: int, step: int, losses: Mapping[str, object]) -> None:
        """Rank `rank` of `world`'s losses of global `step`: {stream: [loss sum, tokens]}.
        Raises ValueError on anything else (an unknown stream, a non-finite or negative sum)."""
        clean: dict[str, list[float]] = {}
        for name, value in losses.items():
            if name not in self.streams:
                raise ValueError(f"unknown stream {name!r} (streams: {', '.join(self.streams)})")
            try:
                total, tokens = (float(v) for v in value)  # type: ignore[attr-defined]
            except (TypeError, ValueError):
                raise ValueError(f"stream {name!r}: expected [loss sum, tokens]") from None
            if not (math.isfinite(total) and total >= 0 and tokens >= 0 and tokens < 2**40):
                raise ValueError(f"stream {name!r}: loss sum {total} over {tokens} tokens")
            clean[name] = [total, tokens]
        with self._lock:
            if world != self.world:  # a new world (a resume): its steps start over
                self.world = world
                self._steps.clear()
            ranks, sums = self._steps.setdefault(step, (set(), {}))
            if rank in ranks:
                return  # a retry, or a rank that re-ran a step after a rewind: counted once
            for name, (total, _) in clean.items():
                if not math.isfinite(sums.get(name, [0.0, 0.0])[0] + total):
                    raise ValueError(f"stream {name!r}: step {step}'s loss sum overflows")
            ranks.add(rank)
            for name, (total, tokens) in clean.items():
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0] += total
                acc[1] += tokens
            self.reports += 1
            while len(self._steps) > self.keep:
                self._steps.popitem(last=False)

    def _complete(self) -> list[tuple[int, dict[str, list[float]]]]:
        world = self.world or 0
        return sorted((s, sums) for s, (ranks, sums) in self._steps.items() if len(ranks) >= world)

    def mean(self, lo: int, hi: int) -> dict[str, float | None] | None:
        """Per stream, the token-weighted mean loss over steps [lo, hi) (None for a stream with
        no labelled token there); None unless every one of those steps is complete."""
        with self._lock:
            acc = {n: [0.0, 0.0] for n in self.streams}
            for step in range(lo, hi):
                got = self._step(step)
                if got is None:
                    return None
                for name, (total, tokens) in got.items():
                    if name not in acc:  # a stream a resume's config change removed
                        continue
                    acc[name][0] += total
                    acc[name][1] += tokens
        return {n: (t / k if k else None) for n, (t, k) in acc.items()}

    def view(self, history: int = 600) -> dict:
        """{streams: {name: {loss, tokens, steps}}, history: [{step, loss: {name: mean},
        tokens: {name: tokens}}]}."""
        with self._lock:
            done = self._complete()
        recent = done[-self.window :]
        streams = {}
        for name in self.streams:
            total = sum(s.get(name, [0, 0])[0] for _, s in recent)
            tokens = sum(s.get(name, [0, 0])[1] for _, s in recent)
            streams[name] = {"loss": total / tokens if tokens else None, "tokens": tokens,
                             "steps": len(recent)}  # fmt: skip
        hist = [
            {"step": step, "loss": {n: (v[0] / v[1] if v[1] else None) for n, v in sums.items()},
             "tokens": {n: v[1] for n, v in sums.items()}}
            for step, sums in done[-history:]
        ]  # fmt: skip
        return {"streams": streams, "history": hist, "reports": self.reports}
