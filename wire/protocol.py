"""The contract between the tokenmill service and its trainer ranks. No dependencies.

Both sides import this module (`service/` and `trainer/`), so the actor's name, its namespace,
the column names, the ignore label and the shape of every call exist once.

A rank talks to the batch-server actor in two concurrency groups: `consumers` for its long
polls (`hello`, `get`), `control` for everything the API and the CLI ask. Each group has its
own threads, so 64 ranks blocked in `get` never starve `/v1/status`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

SERVICE_NAME = "tokenmill"
NAMESPACE = "tokenmill"
# A service's name is a file name (its record, `<name>.json`) and a Ray actor name: letters,
# digits and `-_.`, starting with a letter or digit (so never `.` or `..`), at most 64.
SERVICE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_service_name(name: object) -> str:
    """`name` if it is a valid service name; ValueError saying the rule otherwise."""
    if not isinstance(name, str) or not SERVICE_NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid service name {name!r}: use 1-64 letters, digits, '-', '_' or '.', "
            "starting with a letter or digit"
        )
    return name


# Batch schema (one Arrow record batch per rank per step; see wire/schema.py).
TENSOR_COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
LIST_COLUMNS = ("seq_lens", "stream", "doc_id", "doc_offset")
COLUMNS = TENSOR_COLUMNS + LIST_COLUMNS
IGNORE_LABEL = -100
META_GLOBAL_STEP = b"global_step"
META_RANK = b"rank"
META_WORLD_SIZE = b"world_size"
META_SEQ_LEN = b"seq_len"
META_CONFIG_HASH = b"config_hash"
# A reply's run of consecutive steps: the rows of each step, comma-separated ("4,4,4,2"),
# and global_step the first's.
META_STEP_ROWS = b"step_rows"

# Actor concurrency groups and their sizes (threads). A consumer call waits at most
# POLL_S on the server before it answers `wait`, so a group of this size serves this many
# ranks at once, and a rank that stopped asking is noticed within seconds.
CONSUMER_GROUP = "consumers"
CONTROL_GROUP = "control"
BEAT_GROUP = "beats"  # ranks' liveness beats: never queued behind long polls or the API
# The ranks' loss and data-wait reports: never queued behind calls that wait for them (a
# rank's state under the mixing policy waits for the loss the other ranks report).
REPORT_GROUP = "reports"
CONCURRENCY_GROUPS = {CONSUMER_GROUP: 256, CONTROL_GROUP: 16, BEAT_GROUP: 4, REPORT_GROUP: 4}
# A rank's client beats this often at most (more often under a short rank_timeout_s: a
# quarter of it), with the step it has consumed: liveness follows training, not fetching.
BEAT_S = 5.0
POLL_S = 2.0
# A rank asks for up to this many steps per call (trainer.feed.Feed); it gets at most the
# server's window (service.batch_server.prefetch_window). A rank's cost, and the server's, is mostly
# per call: 32 steps cost ~1/3 of 8 per step (bench/serve_ranks.py).
LOOKAHEAD = 64
# The window's default length when the server holds the steps' rows (lanes: 1). When the
# lanes hold them (lanes > 1) the window holds where they are, and is LOOKAHEAD long: with 16
# lanes and 16 ranks, 64 steps an answer cut the ranks' CPU per step by a fifth to a third and
# the server's by up to a quarter against 32 (docs/performance.md).
WINDOW_STEPS = 32
# An answer holds at most this many bytes of token ids (at least one step): what the rank
# expands to ~8x in int64 tensors, and what the server (or its lanes) may hold per step before
# it makes its window shorter (WINDOW_BYTES).
REPLY_BYTES = 8 << 20
WINDOW_BYTES = 256 << 20
# How long a rank that had to wait for a step may wait for more steps after it (server.get).
LINGER_S = 0.25

# Server states, as `status()["state"]` and `/v1/status` report them.
STARTING, RUNNING, PAUSED, FINISHED, FAILED, STOPPING = (
    "starting", "running", "paused", "finished", "failed", "stopping",
)  # fmt: skip


# What the producer does, as `status()["producer"]` and `metrics()["producer"]` report it.
PRODUCER_STARTING, PRODUCER_MAKING, PRODUCER_WINDOW_FULL = "starting", "making", "window_full"
PRODUCER_PAUSED, PRODUCER_ENDED, PRODUCER_FAILED = "paused", "ended", "failed"
PRODUCER_STOPPING = "stopping"
PRODUCER_WAITING_LOSS = "waiting_for_loss"  # mixing.policy waits for a window's loss


@dataclass(frozen=True)
class Welcome:
    """The answer to `hello(rank, world_size, state, client)` (the first hello declares the
    world): the step this rank pulls first, the world size the service serves, and how often
    its client beats (`beat(rank, world_size, consumed)`)."""

    step: int
    world_size: int
    beat_s: float = BEAT_S
    # Which sequence the rank joined: a resume that restarts the feed makes a new one, and a
    # rank of an older one is refused by `get` (it would wait for steps that never come).
    generation: int = 0


@dataclass(frozen=True)
class StepReply:
    """The answer to `get(rank, world_size, step, wait_s, count)`.

    `ready`: the rank's rows of consecutive steps, from `step` on, in the reply itself, as
    `runs`: each an Arrow IPC stream of one record batch in the compact layout, holding the
    rows of `counts[i]` consecutive steps one after the other (META_STEP_ROWS says how many
    rows each; `wire.arrays.from_ipc`, then `trainer.feed.to_torch_steps`). Steps of one
    schema share a run (a step has `labels` only when a segment masks tokens), so a rank
    decodes a few steps per pass, not each step alone (numpy's per-call cost: ~180 us per
    step of 4 x 2048 tokens alone, ~50 us in a pass). `end`: the data has ended. `wait`: not produced
    yet; `reason` says why (`producing`, `paused`, or the ranks it waits for).

    Why in the reply and not as an ObjectRef (`ray.put` in the server, `ray.get` in the rank,
    as before): a reply under Ray's direct-call limit (100 KB) travels inline with the call's
    answer, and a larger one is stored by Ray as the call's return, owned by the rank. A put
    cost the server a plasma write per call and the rank a second round trip, and the rank
    borrowed an object the server owned. With 8 ranks that consume as fast as they can, that
    put was the server's largest cost (bench/serve_ranks.py)."""

    status: str
    runs: list[Any] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    reason: str = ""
    # With `lanes` K > 1 the rows stay in the lanes that made them, and `ready` says where
    # instead: [(lanes' key, lane, [(step, first row, end row), ...]), ...], in the order a
    # rank joins them; `runs` is empty and `counts` is [steps] (wire/lane_rows.py `fetch`; the
    # key's actors come from the server's `lane_handles`, once).
    lanes: list[Any] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def steps(self) -> int:
        """How many steps the reply holds (or, with lanes, says where to take)."""
        return sum(self.counts)


class StepGone(LookupError):
    """The requested step is no longer held by the server."""


class ServiceBusy(RuntimeError):
    """The service is doing this kind of work already (one provenance replay at a time)."""


class WorldMismatch(ValueError):
    """A rank asked with a world size other than the one the service serves."""


def is_int(v: object) -> bool:
    """An int, and not a bool (`True` is an int to Python, and divides every batch size)."""
    return isinstance(v, int) and not isinstance(v, bool)
