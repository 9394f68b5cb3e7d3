"""The contract between the tokenmill service and its trainer ranks. No dependencies.

Both sides import this module (`service/` and `trainer/`), so the actor's name, its namespace,
the column names, the ignore label and the shape of every call exist once.

A rank talks to the batch-server actor in two concurrency groups: `consumers` for its long
polls (`hello`, `get`), `control` for everything the API and the CLI ask. Each group has its
own threads, so 64 ranks blocked in `get` never starve `/v1/status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SERVICE_NAME = "tokenmill"
NAMESPACE = "tokenmill"

# Batch schema (one Arrow record batch per rank per step; see pipeline/schema.py).
TENSOR_COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
LIST_COLUMNS = ("seq_lens", "stream", "doc_id", "doc_offset")
COLUMNS = TENSOR_COLUMNS + LIST_COLUMNS
IGNORE_LABEL = -100
META_GLOBAL_STEP = b"global_step"
META_RANK = b"rank"
META_WORLD_SIZE = b"world_size"
META_SEQ_LEN = b"seq_len"
META_CONFIG_HASH = b"config_hash"

# Actor concurrency groups and their sizes (threads). A consumer call waits at most
# POLL_S on the server before it answers `wait`, so a group of this size serves this many
# ranks at once, and a rank that stopped asking is noticed within seconds.
CONSUMER_GROUP = "consumers"
CONTROL_GROUP = "control"
CONCURRENCY_GROUPS = {CONSUMER_GROUP: 256, CONTROL_GROUP: 16}
POLL_S = 2.0
# How long a rank that had to wait for a step may wait for more steps after it (server.get).
LINGER_S = 0.25

# Server states, as `status()["state"]` and `/v1/status` report them.
STARTING, RUNNING, PAUSED, FINISHED, FAILED, STOPPING = (
    "starting", "running", "paused", "finished", "failed", "stopping",
)  # fmt: skip


@dataclass(frozen=True)
class Welcome:
    """The answer to `hello(rank, world_size, state)` (the first hello declares the world):
    the step this rank pulls first, and the world size the service serves."""

    step: int
    world_size: int


@dataclass(frozen=True)
class StepReply:
    """The answer to `get(rank, world_size, step, wait_s, count)`.

    `ready`: `steps` holds the rank's slices of consecutive steps, from `step` on, in the reply
    itself: each an Arrow IPC stream of one record batch in the compact layout
    (`pipeline.arrays.from_ipc`, then `pipeline.exports.expand`). `end`: the data has ended.
    `wait`: not produced yet; `reason` says why (`producing`, `paused`, or the ranks it waits
    for).

    Why in the reply and not as an ObjectRef (`ray.put` in the server, `ray.get` in the rank,
    as before): a reply under Ray's direct-call limit (100 KB) travels inline with the call's
    answer, and a larger one is stored by Ray as the call's return, owned by the rank. A put
    cost the server a plasma write per call and the rank a second round trip, and the rank
    borrowed an object the server owned. With 8 ranks that consume as fast as they can, that
    put was the server's largest cost (bench/serve_ranks.py)."""

    status: str
    steps: list[Any] = field(default_factory=list)
    reason: str = ""

    @property
    def ready(self) -> bool:
        return self.status == "ready"


class StepGone(LookupError):
    """The requested step is no longer held by the server."""


class WorldMismatch(ValueError):
    """A rank asked with a world size other than the one the service serves."""
