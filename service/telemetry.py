"""Telemetry of a running service: throughput history, what the producer did and where the
ranks stood over time, data wait per rank, rejects. Ray-free.

Everything is held in bounded deques: an hour of one-second samples of each kind, the last
10,000 wait reports, and at most `max_rejects` bad records between two drains by the `serve`
process (which appends them to the rejects file). Records that overflow the buffer before a
drain are still counted (`rejects_unlisted`), never silently forgotten.

Owner: a Telemetry guards itself with its own lock, so every method may be called from any
thread (the producer's rejects, the ranks' wait reports, the API's reads), with or without the
batch server's lock held; it never calls out while holding its lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping

from pipeline.stages.documents import Reject

WAIT_WINDOW_S = 60.0
RATE_WINDOW_S = 30.0


class Telemetry:
    def __init__(self, max_rejects: int = 10_000, clock=time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self.history: deque = deque(maxlen=3600)  # (t, tokens, rows, shares, targets)
        # (t, producer state, {rank: lag}): the producer's state and each rank's lag (steps
        # consumed behind produced), so that a page opened late still sees how they went.
        self.observations: deque = deque(maxlen=3600)
        self.waits: deque = deque(maxlen=10_000)  # (t, rank, seconds)
        self.rejects: deque = deque(maxlen=max_rejects)
        self.rejects_total = 0
        self.rejects_unlisted = 0

    def due(self, force: bool = False) -> bool:
        """Would a sample be kept now? (One a second: the caller may skip computing it.)"""
        with self._lock:
            return force or not self.history or self.clock() - self.history[-1][0] >= 1.0

    def sample(self, tokens: int, rows: int, shares: dict, targets: dict, force=False) -> None:
        """One throughput sample, at most one a second (the first of a second is kept)."""
        with self._lock:
            now = self.clock()
            if force or not self.history or now - self.history[-1][0] >= 1.0:
                self.history.append((now, tokens, rows, shares, targets))

    def observe(self, producer: str, lags: Mapping[int, int | None]) -> None:
        """What the producer does now and each rank's lag; kept at most once a second, and
        at once whenever the producer's state changes (so a short pause is never missed)."""
        with self._lock:
            now, last = self.clock(), self.observations[-1] if self.observations else None
            if last is None or last[1] != producer or now - last[0] >= 1.0:
                self.observations.append((now, producer, dict(lags)))

    def report_wait(self, rank: int, seconds: float) -> None:
        with self._lock:
            self.waits.append((self.clock(), int(rank), float(seconds)))

    def add_reject(self, reject: Reject) -> None:
        record = reject.as_dict()
        with self._lock:
            self.rejects_total += 1
            if len(self.rejects) == self.rejects.maxlen:
                self.rejects_unlisted += 1
            self.rejects.append(record)

    def drain_rejects(self) -> list[dict]:
        with self._lock:
            out = list(self.rejects)
            self.rejects.clear()
            return out

    def rates(self) -> tuple[float, float]:
        """(tokens/s, rows/s) over the last RATE_WINDOW_S seconds of samples."""
        with self._lock:
            now = self.clock()
            recent = [h for h in self.history if now - h[0] <= RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0, 0.0
        dt = recent[-1][0] - recent[0][0]
        return (recent[-1][1] - recent[0][1]) / dt, (recent[-1][2] - recent[0][2]) / dt

    def wait_by_rank(self, window_s: float = WAIT_WINDOW_S) -> dict[int, tuple[float, int]]:
        """rank -> (seconds waited, reports) over the last `window_s` seconds (at most the
        WAIT_WINDOW_S the status shows; the reports kept may not reach further)."""
        with self._lock:
            now = self.clock()
            waits = list(self.waits)
        out: dict[int, tuple[float, int]] = {}
        for t, rank, s in waits:
            if now - t <= window_s:
                total, n = out.get(rank, (0.0, 0))
                out[rank] = (total + s, n + 1)
        return out

    def history_view(self, last: int = 600) -> list[dict]:
        with self._lock:
            recent = list(self.history)[-last:]
        return [
            {"t": t, "tokens": tok, "rows": rows, "shares": shares, "targets": targets}
            for t, tok, rows, shares, targets in recent
        ]

    def observations_view(self, last: int = 600) -> list[dict]:
        """The last `last` observations: {t, producer, lag: {rank (str): steps}}."""
        with self._lock:
            recent = list(self.observations)[-last:]
        return [
            {"t": t, "producer": producer, "lag": {str(r): v for r, v in lags.items()}}
            for t, producer, lags in recent
        ]
