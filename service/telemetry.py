"""Telemetry of a running service: throughput history, data wait per rank, rejects. Ray-free.

Everything is held in bounded deques: an hour of one-second samples, the last 10,000 wait
reports, and at most `max_rejects` bad records between two drains by the `serve` process
(which appends them to the rejects file). Records that overflow the buffer before a drain
are still counted (`rejects_unlisted`), never silently forgotten.
"""

from __future__ import annotations

import time
from collections import deque

from pipeline.documents import Reject

WAIT_WINDOW_S = 60.0
RATE_WINDOW_S = 30.0


class Telemetry:
    def __init__(self, max_rejects: int = 10_000, clock=time.time):
        self.clock = clock
        self.history: deque = deque(maxlen=3600)  # (t, tokens, rows, shares, targets)
        self.waits: deque = deque(maxlen=10_000)  # (t, rank, seconds)
        self.rejects: deque = deque(maxlen=max_rejects)
        self.rejects_total = 0
        self.rejects_unlisted = 0

    def due(self, force: bool = False) -> bool:
        """Would a sample be kept now? (One a second: the caller may skip computing it.)"""
        return force or not self.history or self.clock() - self.history[-1][0] >= 1.0

    def sample(self, tokens: int, rows: int, shares: dict, targets: dict, force=False) -> None:
        """One throughput sample, at most one a second (the first of a second is kept)."""
        if not self.due(force):
            return
        self.history.append((self.clock(), tokens, rows, shares, targets))

    def report_wait(self, rank: int, seconds: float) -> None:
        self.waits.append((self.clock(), int(rank), float(seconds)))

    def add_reject(self, reject: Reject) -> None:
        self.rejects_total += 1
        if len(self.rejects) == self.rejects.maxlen:
            self.rejects_unlisted += 1
        self.rejects.append(reject.as_dict())

    def drain_rejects(self) -> list[dict]:
        out = list(self.rejects)
        self.rejects.clear()
        return out

    def rates(self) -> tuple[float, float]:
        """(tokens/s, rows/s) over the last RATE_WINDOW_S seconds of samples."""
        now = self.clock()
        recent = [h for h in self.history if now - h[0] <= RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0, 0.0
        dt = recent[-1][0] - recent[0][0]
        return (recent[-1][1] - recent[0][1]) / dt, (recent[-1][2] - recent[0][2]) / dt

    def wait_by_rank(self) -> dict[int, tuple[float, int]]:
        """rank -> (seconds waited, reports) over the last WAIT_WINDOW_S seconds."""
        now = self.clock()
        out: dict[int, tuple[float, int]] = {}
        for t, rank, s in self.waits:
            if now - t <= WAIT_WINDOW_S:
                total, n = out.get(rank, (0.0, 0))
                out[rank] = (total + s, n + 1)
        return out

    def history_view(self, last: int = 600) -> list[dict]:
        return [
            {"t": t, "tokens": tok, "rows": rows, "shares": shares, "targets": targets}
            for t, tok, rows, shares, targets in list(self.history)[-last:]
        ]
