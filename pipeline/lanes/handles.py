"""A lane as the control calls it: in this process (`LocalLane`, answers at once) or in a Ray
actor (`ActorLane`, answers with object refs), and whether an error met calling one says its
process is gone (`lane_died`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pipeline.lanes.placing import wait_placed
from pipeline.lanes.worker import LaneWorker


class LocalLane:
    """A lane in this process: calls answer at once."""

    def __init__(self, worker: LaneWorker):
        self.worker = worker
        self.where = worker.process()  # its pid and host (metrics `lanes`)

    def call(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)

    def get(self, handle) -> Any:
        return handle

    def ready(self, handle) -> bool:
        return True

    def kill(self) -> None:
        self.worker.close()


class ActorLane:
    """A lane in a Ray actor: calls answer with object refs. Its first answer is asked at
    once (`where`: its pid and host); until it comes, `get` waits for it up to
    `place_timeout_s` from now (placing.py `wait_placed`), so that a lane no node can hold
    fails the run naming it (`what`) and what it asks (`resources`) instead of waiting for
    ever."""

    def __init__(self, handle, what: str = "a lane", resources: dict[str, float] | None = None,
                 place_timeout_s: float | None = None):  # fmt: skip
        self.handle = handle
        self.where = handle.process.remote()
        self.what, self.resources = what, dict(resources or {})
        self.place_timeout_s = place_timeout_s
        self.since = time.monotonic()
        self.placed = False  # set once `where` was answered (by any thread: a flag only)

    def call(self, method: str, *args) -> Any:
        return getattr(self.handle, method).remote(*args)

    def overdue(self) -> bool:
        """Not placed and started within `place_timeout_s` (asked without waiting: a lane a
        rank's call started again, which nothing else may ask while the ranks set the pace)."""
        if self.placed:
            return False
        if self.ready(self.where):
            self.placed = True
            return False
        timeout_s = self.place_timeout_s
        return timeout_s is not None and time.monotonic() >= self.since + timeout_s

    def get(self, ref) -> Any:
        import ray

        if not self.placed:
            wait_placed(self.where, self.what, self.resources, self.place_timeout_s, self.since)
            self.placed = True
        return ray.get(ref)

    def ready(self, ref) -> bool:
        import ray

        return bool(ray.wait([ref], timeout=0)[0])

    def kill(self) -> None:
        import ray

        if self.placed or self.ready(self.where):
            with contextlib.suppress(Exception):  # a dead lane has nothing left to close
                ray.get(self.handle.close.remote(), timeout=30)
        ray.kill(self.handle)


def lane_died(error: BaseException) -> bool:
    """Whether `error`, met asking a lane actor, says its process is gone (killed, its node
    lost), as opposed to a failure of the lane's own work (a bad record, a bug)."""
    import ray.exceptions

    # ObjectLostError: an answer kept on the lane's node, lost with it.
    return isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ObjectLostError)
