"""The trainer's feed client (SPEC §3.4): pull this rank's batches from a tokenmill service.

    feed = Feed.connect(service="tokenmill", rank=r, world_size=w)
    for batch in feed:            # dict of torch tensors [B, L], plus seq_lens and global_step
        ...
        feed.report_wait(seconds)
    state = feed.state_dict()     # store in the checkpoint; Feed.connect(..., state=state) resumes

A batch arrives as an Arrow record batch in Ray's shared-memory object store; the ids are
read in place and copied once, into int64 torch tensors. If the service dies, the next call
raises within seconds; a live but stuck service raises after `timeout_s`. Nothing hangs.
"""

from __future__ import annotations

import time

import numpy as np

NAMESPACE = "tokenmill"
COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")


class FeedError(RuntimeError):
    """The service is gone, failed, or does not answer."""


def to_torch(batch) -> dict:
    import torch

    n = batch.num_rows
    meta = batch.schema.metadata or {}
    out = {}
    for name in COLUMNS:
        col = batch.column(name)
        L = col.type.list_size
        flat = col.values.to_numpy(zero_copy_only=True)[col.offset * L : (col.offset + n) * L]
        out[name] = torch.from_numpy(flat.reshape(n, L).astype(np.int64))  # the one copy
    out["seq_lens"] = batch.column("seq_lens").to_pylist()
    out["global_step"] = int(meta.get(b"global_step", b"-1"))
    return out


class Feed:
    def __init__(self, server, rank: int, world_size: int, step: int, timeout_s: float):
        self.server, self.rank, self.world_size = server, rank, world_size
        self.step = step
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, service: str = "tokenmill", rank: int = 0, world_size: int = 1,
                address: str | None = None, state: dict | None = None,
                timeout_s: float = 60.0) -> Feed:  # fmt: skip
        import ray

        if not ray.is_initialized():
            ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)  # fmt: skip
        deadline = time.time() + timeout_s
        while True:
            try:
                server = ray.get_actor(service, namespace=NAMESPACE)
                break
            except ValueError:
                if time.time() > deadline:
                    raise FeedError(
                        f"no tokenmill service named {service!r} within {timeout_s}s"
                    ) from None
                time.sleep(0.5)
        feed = cls(server, rank, world_size, 0, timeout_s)
        if state is not None:
            feed.step = feed._call("seek", state)
        else:
            feed.step = feed._call("first_step")
        return feed

    def _call(self, method: str, *args):
        import ray

        try:
            return ray.get(getattr(self.server, method).remote(*args), timeout=self.timeout_s + 5)
        except ray.exceptions.GetTimeoutError:
            raise FeedError(
                f"the tokenmill service did not answer {method} within {self.timeout_s}s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError) as e:
            raise FeedError(f"the tokenmill service is gone: {type(e).__name__}") from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise FeedError(str(cause or e)) from None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        import ray

        wrapped = self._call("get", self.rank, self.world_size, self.step, self.timeout_s)
        if wrapped is None:
            raise StopIteration
        try:
            batch = ray.get(wrapped[0], timeout=self.timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise FeedError(f"cannot fetch step {self.step}: {type(e).__name__}") from None
        self.step += 1
        return to_torch(batch)

    def report_wait(self, seconds: float) -> None:
        self.server.report_wait.remote(self.rank, float(seconds))  # fire and forget

    def state_dict(self) -> dict:
        """The feed state after the last step this rank consumed (same on every rank)."""
        return self._call("state", self.step)

    def close(self) -> None:
        self.server = None
