"""Asking the cluster for CPUs while the trainer ranks wait for data (`service.autoscale`).
Ray-free: the service gives it the signals and a function that places the request.

Tokenizing runs in Ray Data's tasks, which use every CPU the cluster has: more CPUs are more
tokenizers, with nothing else to change. On a cluster with an autoscaler (KubeRay, or
`ray up`), `ray.autoscaler.sdk.request_resources(num_cpus=N)` asks it to hold at least N CPUs
(it adds nodes; without an autoscaler the request is kept and nothing happens). So the rule
follows the two signals the service already has:

- the ranks' data wait (what they report, `Feed.report_wait`): the share of the last
  `WINDOW_S` seconds the worst-waiting rank spent waiting (a synchronous step waits for its
  slowest rank);
- the producer's state over the same window: `window_full` is the service being ahead of the
  trainers (nothing to gain from more CPUs); `making` while ranks wait is the service behind.

Up: the worst rank waited `up_wait` (5%) or more of the window while the producer was making
steps half of it or more (not paused, not ahead): ask for a quarter more CPUs than the cluster
has now (at least one), up to `max_cpus`. Down: the producer waited on a full window 90% or more of it and no rank
waited over a fifth of `up_wait`: withdraw the request (the autoscaler may remove idle nodes
again). At most one change per `cooldown_s`, so that a change has time to show in the
signals. Every change is kept with its reason (`/v1/status` `autoscale`, the page, Prometheus
`tokenmill_autoscale_requested_cpus`).

Owner: `Demand` is called from one thread (the service's autoscale thread); `view` copies.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping

WINDOW_S = 60.0  # the signals' window (the telemetry keeps data wait for 60 s)
DOWN_FULL = 0.9  # the producer waited on a full window this much of it: withdraw


def producer_shares(observations: Iterable[tuple[float, str]], now: float) -> dict[str, float]:
    """Per producer state, its share of the last WINDOW_S seconds, from (t, state) samples
    (each state lasts until the next sample; the last one until `now`)."""
    obs = sorted(observations)
    start = now - WINDOW_S
    out: dict[str, float] = {}
    for i, (t, state) in enumerate(obs):
        end = obs[i + 1][0] if i + 1 < len(obs) else now
        lo, hi = max(t, start), min(end, now)
        if hi > lo:
            out[state] = out.get(state, 0.0) + (hi - lo)
    seen = sum(out.values())
    return {k: v / seen for k, v in out.items()} if seen else {}


class Demand:
    def __init__(self, max_cpus: int, up_wait: float, cooldown_s: float):
        self.max_cpus = max_cpus
        self.up_wait = up_wait
        self.cooldown_s = cooldown_s
        self.requested = 0  # CPUs asked for (0: no request)
        self.changes: deque[dict] = deque(maxlen=100)
        self._last_change = -math.inf
        self._lock = threading.Lock()

    def decide(self, now: float, waits: Mapping[int, float], shares: Mapping[str, float],
               cluster_cpus: float) -> tuple[int, str] | None:  # fmt: skip
        """The new request and its reason, or None (no change). `waits`: per rank, seconds
        waited over the window; `shares`: `producer_shares`; `cluster_cpus`: now."""
        if now - self._last_change < self.cooldown_s or not shares:
            return None
        worst = max(waits.values(), default=0.0) / WINDOW_S
        full = shares.get("window_full", 0.0)
        making = shares.get("making", 0.0) + shares.get("starting", 0.0)
        if worst >= self.up_wait and making >= 0.5:
            have = max(self.requested, int(cluster_cpus))
            want = min(self.max_cpus, have + max(1, math.ceil(have / 4)))
            if want <= self.requested:
                return None  # at the most already
            return want, (
                f"ranks waited up to {worst:.0%} of the last {WINDOW_S:.0f} s while the "
                f"producer was making steps {making:.0%} of it: asking for {want} CPUs "
                f"(the cluster has {cluster_cpus:g})"
            )
        if self.requested and full >= DOWN_FULL and worst < self.up_wait / 5:
            return 0, (
                f"the producer waited on a full window {full:.0%} of the last {WINDOW_S:.0f} s "
                f"and no rank waited: withdrawing the request for {self.requested} CPUs"
            )
        return None

    def changed(self, now: float, cpus: int, reason: str, error: str | None) -> None:
        """Record a change (placed, or `error` if the request failed)."""
        with self._lock:
            self._last_change = now
            if error is None:
                self.requested = cpus
            self.changes.append({"t": now, "requested_cpus": cpus, "reason": reason,
                                 "error": error})  # fmt: skip

    def view(self) -> dict:
        with self._lock:
            return {"max_cpus": self.max_cpus, "requested_cpus": self.requested,
                    "changes": list(self.changes)}  # fmt: skip
