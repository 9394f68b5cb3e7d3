"""The service's autoscale thread (`service.autoscale`): every tick, the ranks' data wait and
the producer's states go to `Demand` (service/demand.py, the rule), and what it decides is
placed on the cluster.

Requests go through Ray Data's autoscaling coordinator, renewed every tick with an expiry of
`EXPIRE_S` (a killed service's request lapses), and are withdrawn when the service closes.
Every call to the coordinator is made on this thread. The cluster is read and the requests
placed through two functions given to `Autoscaler` (Ray's, by default), so that the loop
itself (decide, renew, withdraw) is tested without a cluster (tests/test_demand.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from service.demand import Demand, producer_shares

TICK_S = 5.0  # how often the thread looks at the signals
EXPIRE_S = 60.0  # a request lapses unless renewed (every tick) within this

Place = Callable[[int], None]  # ask for N CPUs; 0 withdraws the request


def coordinator_place(requester_id: str) -> Callable[[], Place]:
    """How a request for N CPUs is placed: through Ray Data's autoscaling coordinator, as one
    of its requesters (it merges them all for the autoscaler and would overwrite a direct
    request within 20 s), with an expiry renewed every tick; on a Ray without it,
    `ray.autoscaler.sdk.request_resources` (no expiry).

    The coordinator's module is imported here, on the caller's thread, and the coordinator is
    built by the returned function on the autoscale thread. Call this before any Ray Data
    execution starts in the process: ray.data's modules import one another, many of them
    inside functions, and importing the coordinator on one thread while the producer's Ray
    Data execution imports its modules on another met Python's import deadlock in CI
    (`_DeadlockError` on `ray.data._internal.execution.interfaces.common`), which failed the
    feed and left `ray.data` half-imported for every later user in the process."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            DefaultAutoscalingCoordinator,
        )
    except ImportError:
        from ray.autoscaler.sdk import request_resources

        return lambda: lambda n: request_resources(num_cpus=n)

    def build() -> Place:
        coordinator = DefaultAutoscalingCoordinator(requester_id)

        def place(n: int) -> None:
            if n:
                coordinator.request_resources([{"CPU": 1}] * n, expire_after_s=EXPIRE_S)
            else:
                coordinator.cancel_request()

        return place

    return build


def ray_cluster_now() -> tuple[int, float]:
    """The cluster's live nodes and CPUs, as Ray sees them now."""
    import ray

    cpus = float(ray.cluster_resources().get("CPU", 0))
    return sum(1 for n in ray.nodes() if n.get("Alive")), cpus


def _placed(place: Place, cpus: int) -> str | None:
    """`place(cpus)`; the error, if it failed (recorded with the change, not raised)."""
    try:
        place(cpus)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


class Autoscaler:
    """The thread. `waits()`: per rank, seconds waited over the last minute; `observed()`:
    the producer's (t, state) samples; `cluster()`: (live nodes, CPUs), raising when the
    cluster does not answer (no decision that tick); `place`: made on the thread, so that a
    coordinator built lazily is only ever called from it."""

    def __init__(self, demand: Demand, waits: Callable[[], dict[int, float]],
                 observed: Callable[[], list[tuple[float, str]]],
                 place: Callable[[], Place], cluster: Callable[[], tuple[int, float]] = ray_cluster_now,
                 tick_s: float = TICK_S):  # fmt: skip
        self.demand = demand
        self._waits, self._observed, self._make_place = waits, observed, place
        self._cluster, self._tick_s = cluster, tick_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-autoscale", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; it withdraws its request as it ends."""
        self._closed.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        demand, place = self.demand, self._make_place()
        while not self._closed.wait(self._tick_s):
            now = time.time()  # the telemetry's clock
            try:
                nodes, cpus = self._cluster()
            except Exception:
                continue  # the cluster not answering now: no decision this tick
            demand.seen(nodes, cpus)
            decided = demand.decide(
                now, self._waits(), producer_shares(self._observed(), now, demand.window_s), cpus
            )
            if decided is not None:
                want, reason = decided
                demand.changed(now, want, reason, _placed(place, want), cpus)
            elif demand.requested:
                _placed(place, demand.requested)  # renewed before it expires
        if demand.requested and _placed(place, 0) is None:
            demand.changed(time.time(), 0, "the service closed", None)
