"""Waiting for an actor of the service (a lane, the batch server) to be placed and started,
for a bounded time (`service.place_timeout_s`), saying what it waits for.

Ray waits for ever for an actor whose resources no node has (`service.resources` naming a
label no node carries, or one that went with its node): without a deadline, an export with such
lanes would wait silently until killed. The wait is for the actor's first answer, so it covers its
placement and its constructor (a lane's feed lists and opens its files): after PLACE_NOTE_S a
line says what it waits for, and at the deadline the run fails naming the actor, what it
asks and what the nodes lack. Why not fail at once when no node has the resources: an
autoscaler (KubeRay, `ray up`) adds nodes for pending actors, and nothing tells the service
whether one runs."""

from __future__ import annotations

import sys
import time
from typing import Any

PLACE_NOTE_S = 10.0  # an actor not started by then is said to wait, and for what
# Ray's own resources, left out when naming the labels the nodes carry
BUILT_IN = ("CPU", "GPU", "memory", "object_store_memory", "node:", "accelerator_type:")


class NotPlaced(RuntimeError):
    """An actor of the service was not placed and started within `service.place_timeout_s`."""


def why_waiting(resources: dict[str, float]) -> str:
    """What an actor asking `resources` (service.resources; num_cpus 0) waits for: a node that
    has them, or one of those that have them to free them, or (none asked) its own start."""
    import ray

    starting = ("a batch server starts its lanes, a lane's feed lists and opens its files, "
                "and a busy machine starts processes slowly")  # fmt: skip
    if not resources:
        return f"it asks no resources (num_cpus 0), so it is still starting ({starting})"
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if all(n["Resources"].get(r, 0.0) >= q for r, q in resources.items())]
    if not fits:
        labels = sorted({r for n in nodes for r in n["Resources"] if not r.startswith(BUILT_IN)})
        return (f"it asks {resources} (service.resources) and no node of the cluster has "
                f"that much (the nodes' own resources: {labels or 'none'}); start a node with "
                "them (`ray start --resources`), or change service.resources")  # fmt: skip
    free = ray.available_resources()
    short = {r: free.get(r, 0.0) for r, q in resources.items() if free.get(r, 0.0) < q}
    if not short:
        return (f"it asks {resources} (service.resources), which the nodes have free: it is "
                f"still starting ({starting})")  # fmt: skip
    # The actor may hold them itself, placed and still starting: Ray does not say which.
    return (f"it asks {resources} (service.resources), which {len(fits)} node(s) have, "
            f"{short} free now: it waits for the actors that hold them to end, or holds them "
            "itself and is still starting")  # fmt: skip


def not_placed(what: str, resources: dict[str, float], timeout_s: float,
               limit: str = "service.place_timeout_s") -> NotPlaced:  # fmt: skip
    """The error of `what`, not placed and started within `timeout_s` (`limit` says whence)."""
    return NotPlaced(
        f"{what} was not placed and started within {timeout_s:g} s ({limit}): "
        f"{why_waiting(resources)}"
    )


def wait_placed(first: Any, what: str, resources: dict[str, float], timeout_s: float | None,
                since: float, limit: str = "service.place_timeout_s") -> None:  # fmt: skip
    """Waits for `first` (an ObjectRef: the actor's first call, answered once it was placed
    and its constructor ran; an error answered counts) up to `timeout_s` from `since`
    (time.monotonic, when the actor was asked for). Says on stderr what `what` (e.g. "lane 1
    of 4") waits for once PLACE_NOTE_S have passed (an actor's stderr goes to Ray's logs);
    raises NotPlaced at the deadline, saying whence it came (`limit`)."""
    import ray

    noted = False
    while True:
        now = time.monotonic()
        wait = PLACE_NOTE_S if noted else max(0.0, since + PLACE_NOTE_S - now)
        if timeout_s is not None:
            wait = min(wait, max(0.0, since + timeout_s - now))
        if ray.wait([first], timeout=wait)[0]:
            return
        if timeout_s is not None and time.monotonic() >= since + timeout_s:
            raise not_placed(what, resources, timeout_s, limit)
        if not noted:
            print(f"tokenmill: {what} has not started after {PLACE_NOTE_S:g} s: "
                  f"{why_waiting(resources)}", file=sys.stderr, flush=True)  # fmt: skip
            noted = True
