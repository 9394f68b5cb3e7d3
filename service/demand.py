"""Asking the cluster for CPUs while the trainer ranks wait for data (`service.autoscale`).
Ray-free: the service gives it the signals and places the requests.

Tokenizing runs on the cluster's CPUs (Ray Data's tasks use them all; the warm pool of a
service on a running cluster grows to them, pipeline/read/pool.py): more CPUs are more
tokenizers, with nothing else to change. On a cluster with an autoscaler (KubeRay, `ray up`)
the service asks for them the way Ray Data's own autoscaling does, through its autoscaling
coordinator, which merges every requester's requests for the autoscaler (a direct
`request_resources` would be overwritten by it within 20 s), with an expiry the service
renews while it wants them: a service that dies leaves no request behind. The rule follows
two signals the service already has:

- the ranks' data wait (what they report, `Feed.report_wait`): the share of the last
  `window_s` seconds (60 by default) the worst-waiting rank spent waiting (a synchronous step
  waits for its slowest rank);
- the producer's state over the same window: `window_full` is the service being ahead of the
  trainers (nothing to gain from more CPUs); `making` while ranks wait is the service behind.

Up: the worst rank waited `up_wait` (5%) or more of the window while the producer was making
steps half of it or more (not paused, not starting, not ahead): ask for a quarter more CPUs
than the cluster has (at least one), up to `max_cpus`; not again before the cluster has what
was asked (nodes take minutes). Down, with hysteresis: the producer waited on a full window 90%
of the window and no rank waited over a fifth of `up_wait`, for `DOWN_AFTER` cooldowns since
the last change: ask for a fifth less, and withdraw the request once that is what the cluster
had without it. At most one change per `cooldown_s`; no decision before the producer's states
cover half the window (a start-up is no minute to judge). Every change is kept with its
reason (`/v1/status` `autoscale`, the page, Prometheus `tokenmill_autoscale_requested_cpus`).

Owner: `Demand` is called from one thread (the service's autoscale thread); `view` copies.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping

WINDOW_S = 60.0  # the signals' window (the telemetry keeps data wait for 60 s)
DOWN_FULL = 0.9  # the producer waited on a full window this much of it: step down
SEEN = 0.5  # no decision before the producer's states cover this share of the window
DOWN_AFTER = 3  # a step down waits this many cooldowns after the last change (hysteresis)


def producer_shares(observations: Iterable[tuple[float, str]], now: float,
                    window_s: float = WINDOW_S) -> dict[str, float]:  # fmt: skip
    """Per producer state, its share of the last `window_s` seconds, from (t, state) samples
    (each state lasts until the next sample; the last one until `now`). Empty until the
    samples cover SEEN of the window: a service that just started has no minute to judge."""
    obs = sorted(observations)
    start = now - window_s
    out: dict[str, float] = {}
    for i, (t, state) in enumerate(obs):
        end = obs[i + 1][0] if i + 1 < len(obs) else now
        lo, hi = max(t, start), min(end, now)
        if hi > lo:
            out[state] = out.get(state, 0.0) + (hi - lo)
    seen = sum(out.values())
    return {k: v / seen for k, v in out.items()} if seen >= SEEN * window_s else {}


class Demand:
    def __init__(self, max_cpus: int, up_wait: float, cooldown_s: float,
                 window_s: float = WINDOW_S):  # fmt: skip
        self.max_cpus = max_cpus
        self.up_wait = up_wait
        self.cooldown_s = cooldown_s
        self.window_s = window_s  # the signals' window: waits and shares over its last seconds
        self.requested = 0  # CPUs asked for (0: no request)
        self.base = 0  # about what the cluster had before the first request
        self.changes: deque[dict] = deque(maxlen=100)
        # The cluster as last seen (each tick): its live nodes and CPUs, so that a node the
        # autoscaler added shows (status `autoscale`, the page, Prometheus).
        self.cluster: dict = {"nodes": None, "cpus": None}
        self._last_change = -math.inf
        self._lock = threading.Lock()

    def decide(self, now: float, waits: Mapping[int, float], shares: Mapping[str, float],
               cluster_cpus: float) -> tuple[int, str] | None:  # fmt: skip
        """The new request and its reason, or None (no change). `waits`: per rank, seconds
        waited over the window; `shares`: `producer_shares`; `cluster_cpus`: now."""
        since = now - self._last_change
        if since < self.cooldown_s or not shares:
            return None
        worst = max(waits.values(), default=0.0) / self.window_s
        full = shares.get("window_full", 0.0)
        making = shares.get("making", 0.0)
        if worst >= self.up_wait and making >= 0.5:
            if self.requested and cluster_cpus < self.requested:
                return None  # the nodes asked for are not all up yet: wait for them
            have = int(cluster_cpus)
            want = min(self.max_cpus, have + max(1, math.ceil(have / 4)))
            if want <= max(self.requested, have):
                return None  # at max_cpus, or the cluster has that many already
            return want, (
                f"ranks waited up to {worst:.0%} of the last {self.window_s:.0f} s while the "
                f"producer was making steps {making:.0%} of it: asking for {want} CPUs "
                f"(the cluster has {cluster_cpus:g})"
            )
        ahead = full >= DOWN_FULL and worst < self.up_wait / 5
        if self.requested and ahead and since >= DOWN_AFTER * self.cooldown_s:
            down = self.requested - max(1, math.ceil(self.requested / 5))
            down = 0 if down <= self.base else down
            return down, (
                f"the producer waited on a full window {full:.0%} of the last {self.window_s:.0f} s "
                f"and no rank waited over {self.up_wait / 5:.0%} of it: "
                + (f"asking for {down} CPUs" if down else "withdrawing the request")
                + f" (was {self.requested})"
            )
        return None

    def changed(self, now: float, cpus: int, reason: str, error: str | None,
                cluster_cpus: float = 0.0) -> None:  # fmt: skip
        """Record a change (placed, or `error` if the request failed); `cluster_cpus`: the
        cluster's CPUs when it was decided."""
        with self._lock:
            self._last_change = now
            if error is None:
                if not self.requested:
                    self.base = int(cluster_cpus)  # what it had without a request
                self.requested = cpus
            self.changes.append({"t": now, "requested_cpus": cpus, "reason": reason,
                                 "error": error})  # fmt: skip

    def seen(self, nodes: int, cpus: float) -> None:
        """The cluster's live nodes and CPUs now."""
        with self._lock:
            self.cluster = {"nodes": nodes, "cpus": cpus}

    def view(self) -> dict:
        with self._lock:
            return {"max_cpus": self.max_cpus, "requested_cpus": self.requested,
                    "base_cpus": self.base, "changes": list(self.changes),
                    "cluster": dict(self.cluster)}  # fmt: skip
