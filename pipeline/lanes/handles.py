"""A lane as the control calls it: in this process (`LocalLane`, answers at once) or in a Ray
actor (`ActorLane`, answers with object refs), and whether an error met calling one says its
process is gone (`lane_died`)."""

from __future__ import annotations

import contextlib
from typing import Any

from pipeline.lanes.worker import LaneWorker


class LocalLane:
    """A lane in this process: calls answer at once."""

    def __init__(self, worker: LaneWorker):
        self.worker = worker

    def call(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)

    def get(self, handle) -> Any:
        return handle

    def ready(self, handle) -> bool:
        return True

    def kill(self) -> None:
        self.worker.close()


class ActorLane:
    """A lane in a Ray actor: calls answer with object refs."""

    def __init__(self, handle):
        self.handle = handle

    def call(self, method: str, *args) -> Any:
        return getattr(self.handle, method).remote(*args)

    def get(self, ref) -> Any:
        import ray

        return ray.get(ref)

    def ready(self, ref) -> bool:
        import ray

        return bool(ray.wait([ref], timeout=0)[0])

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # a dead lane has nothing left to close
            ray.get(self.handle.close.remote(), timeout=30)
        ray.kill(self.handle)


def lane_died(error: BaseException) -> bool:
    """Whether `error`, met asking a lane actor, says its process is gone (killed, its node
    lost), as opposed to a failure of the lane's own work (a bad record, a bug)."""
    import ray.exceptions

    # ObjectLostError: an answer kept on the lane's node, lost with it.
    return isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ObjectLostError)
