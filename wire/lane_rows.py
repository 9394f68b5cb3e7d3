"""Rows held by lanes: which lane holds which of a rank's rows, and how a rank joins them.

With `lanes` K > 1 the batch server never touches token data: each lane actor keeps the rows
it made (its G/K rows of every step) until every rank has fetched them, and the server answers
a rank's `get` with where its rows are (`StepReply.lanes`: per lane, its feed's key, its
number and the row ranges of each step; the rank asks for a key's actors once, LaneActors).
The rank then takes them from the lanes straight (`fetch`), all lanes at once. A rank whose
rows lie in one lane (K divides the world size, the usual case) gets that lane's runs as they
are; a rank whose rows span lanes (a world smaller than K, or the short last step) joins each
step's pieces in lane order, as the server did before.

    global step s:  lane 0: rows [0, G/K)   lane 1: rows [G/K, 2G/K)   …
    rank r of W:    rows [r·G/W, (r+1)·G/W)  →  the lanes those rows fall in, sliced

The rows a rank gets are the same rows, in the same order, as when the server joined the
lanes' parts itself and cut out the rank's slice (the sequence never depends on who joins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from wire.arrays import from_ipc, to_ipc
from wire.layout import compact, expand
from wire.protocol import META_RANK, META_STEP_ROWS, META_WORLD_SIZE

TAKE_GROUP = "serve"  # a lane actor's threads that hand out rows (its feed has one thread)
TAKE_THREADS = 16


class LaneGone(RuntimeError):
    """A lane that holds a rank's rows is gone (its process died, or the sequence was
    replaced); the message names the lane, and `key`, `lane` and `handle` (the actor asked)
    say which (None: not known)."""

    def __init__(self, message: str, key: str | None = None, lane: int | None = None,
                 handle: Any = None):  # fmt: skip
        super().__init__(message)
        self.key, self.lane, self.handle = key, lane, handle


def rank_rows(num_rows: int, rank: int, world_size: int, global_batch_size: int) -> slice:
    """Which rows of a global step of `num_rows` rows are rank `rank`'s (the last step may be
    short, and leave a rank fewer rows, or none)."""
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by world size {world_size}"
        )
    per_rank = global_batch_size // world_size
    start = min(rank * per_rank, num_rows)
    return slice(start, min(start + per_rank, num_rows))


def lane_parts(
    lane_rows: list[int], rank: int, world_size: int, global_batch_size: int
) -> list[tuple[int, int, int]]:
    """Rank `rank`'s rows of one global step whose lanes made `lane_rows` rows each, as
    (lane, first row, end row) in that lane's part, in lane order. A rank with no row of the
    step (a short last step) gets one empty part, so that it still sees the step."""
    mine = rank_rows(sum(lane_rows), rank, world_size, global_batch_size)
    out, at = [], 0
    for k, n in enumerate(lane_rows):
        lo, hi = max(mine.start, at), min(mine.stop, at + n)
        if lo < hi:
            out.append((k, lo - at, hi - at))
        at += n
    if not out:
        k = len(lane_rows) - 1
        out.append((k, lane_rows[k], lane_rows[k]))
    return out


def plan(
    steps: list[tuple[int, list[int]]], rank: int, world_size: int, global_batch_size: int
) -> dict[int, list[tuple[int, int, int]]]:
    """For consecutive `steps` ((step, rows of each lane)), what rank `rank` takes from each
    lane: lane -> [(step, first row, end row), ...], lanes in order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for step, rows in steps:
        for k, lo, hi in lane_parts(rows, rank, world_size, global_batch_size):
            out.setdefault(k, []).append((step, lo, hi))
    return dict(sorted(out.items()))


def rank_meta(batch: pa.RecordBatch, rank: int, world_size: int) -> dict:
    """The batch's metadata, naming rank `rank` of `world_size` as the rows' owner."""
    meta = dict(batch.schema.metadata or {})
    meta[META_RANK], meta[META_WORLD_SIZE] = str(rank).encode(), str(world_size).encode()
    return meta


def runs_of(
    parts: list[pa.RecordBatch], rank: int, world_size: int
) -> list[tuple[pa.RecordBatch, int]]:
    """Consecutive steps' parts (one record batch each, in step order) joined into runs of one
    schema: each run one record batch of their rows in order, with `global_step` the first
    step's and `step_rows` the rows of each step ("4,4,2"), and how many steps it holds. A
    reader cuts it back into steps by those counts (trainer.feed.to_torch_steps)."""
    runs: list[list[pa.RecordBatch]] = []
    for part in parts:
        if runs and runs[-1][0].schema.equals(part.schema, check_metadata=False):
            runs[-1].append(part)
        else:
            runs.append([part])
    out = []
    for run in runs:
        meta = rank_meta(run[0], rank, world_size)
        meta[META_STEP_ROWS] = ",".join(str(p.num_rows) for p in run).encode()
        joined = pa.concat_batches(run) if len(run) > 1 else run[0]
        out.append((joined.replace_schema_metadata(meta), len(run)))
    return out


def join_parts(parts: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One step's rows from its lanes' pieces, in lane order, with the first's metadata. Parts
    that differ in layout (one kept labels it could not derive) are joined in full and then
    compacted again, keeping labels."""
    meta = parts[0].schema.metadata
    if len(parts) == 1:
        return parts[0]
    if any(not p.schema.equals(parts[0].schema, check_metadata=False) for p in parts):
        keep_labels = any("labels" in p.schema.names for p in parts)
        full = pa.concat_batches([expand(p).replace_schema_metadata(None) for p in parts])
        joined = compact(full, keep_labels=keep_labels)
    else:
        joined = pa.concat_batches([p.replace_schema_metadata(None) for p in parts])
    return joined.replace_schema_metadata(meta)


def split_run(run: pa.RecordBatch) -> list[pa.RecordBatch]:
    """A run's steps, each its own record batch (zero-copy slices), with the run's metadata
    and `global_step` its own."""
    meta = dict(run.schema.metadata or {})
    rows = [int(r) for r in meta.pop(META_STEP_ROWS).split(b",")]
    first = int(meta[b"global_step"])
    out, at = [], 0
    for i, n in enumerate(rows):
        out.append(
            run.slice(at, n).replace_schema_metadata(
                meta | {b"global_step": str(first + i).encode()}
            )
        )
        at += n
    return out


class LaneActors:
    """A rank's lookup of lane actors by their feed's key (`StepReply.lanes` names lanes by
    key; pipeline/lanes/steps.py `where`): asked of the server once per key (`lookup`, the server's
    `lane_handles`), then kept. Only the latest few are kept: a skip's replaced lanes are not
    asked for again once their steps are taken."""

    KEEP = 8

    def __init__(self, lookup: Callable[[str], Sequence[Any]]):
        self.lookup = lookup
        self.known: dict[str, Sequence[Any]] = {}

    def __call__(self, key: str) -> Sequence[Any]:
        if key not in self.known:
            self.known[key] = self.lookup(key)
            while len(self.known) > self.KEEP:
                self.known.pop(next(iter(self.known)))
        return self.known[key]

    def renew(self, key: str, handles: Sequence[Any]) -> None:
        """A key's actors as the server has them now (a lane started again)."""
        self.known[key] = handles


def fetch_again(
    lanes: list[tuple[str, int, list[tuple[int, int, int]]]],
    rank: int,
    world_size: int,
    timeout_s: float,
    actors: LaneActors,
    gone: Callable[[str, int], Sequence[Any]],
    tries: int = 4,
) -> tuple[list[bytes], list[int]]:
    """`fetch`, asked again when a lane is gone: `gone(key, lane)` (the server's
    `lane_gone`) starts the lane again if its process died and gives the lanes' actors as
    they are now. Its new actor makes the steps again, the same rows, and hands them out once
    made. After `tries` lanes gone in a row, or a lane the server does not start again, the
    LaneGone stands."""
    for attempt in range(tries + 1):
        try:
            return fetch(lanes, rank, world_size, timeout_s, actors)
        except LaneGone as e:
            if e.key is None or e.lane is None or attempt == tries:
                raise
            now = gone(e.key, e.lane)
            actors.renew(e.key, now)
            if now[e.lane] == e.handle:  # not started again (no restarts left): it is gone
                raise
    raise AssertionError("unreachable")


def fetch(
    lanes: list[tuple[str, int, list[tuple[int, int, int]]]],
    rank: int,
    world_size: int,
    timeout_s: float,
    actors: Callable[[str], Sequence[Any]],
) -> tuple[list[bytes], list[int]]:
    """A rank's rows from the lanes that hold them (`StepReply.lanes`: per lane, its feed's
    key, its number and the rows), all asked at once: its runs (Arrow IPC) and the steps in
    each. `actors` gives a key's lane actors (LaneActors). Raises LaneGone naming a lane that
    is gone and TimeoutError past `timeout_s`; a step a lane no longer holds is the lane's
    LookupError."""
    import ray

    asked = [(key, k, parts, actors(key)[k]) for key, k, parts in lanes]
    calls = [
        (key, k, parts, handle, handle.take.options(concurrency_group=TAKE_GROUP).remote(
            parts, rank, world_size))
        for key, k, parts, handle in asked
    ]  # fmt: skip
    answers = []
    for key, k, parts, handle, ref in calls:
        try:
            answers.append(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"lane {k} did not hand out its rows within {timeout_s:.0f}s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError) as e:
            raise LaneGone(
                f"lane {k}, holding rows of steps {parts[0][0]}.., is gone "
                f"({type(e).__name__}): its sequence was replaced or its process died",
                key=key,
                lane=k,
                handle=handle,
            ) from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (
                cause
                if isinstance(cause, LookupError | TimeoutError)
                else RuntimeError(str(cause or e))
            ) from None
    if len(answers) == 1:  # the rank's rows lie in one lane: its runs as they came
        return [run for run, _ in answers[0]], [n for _, n in answers[0]]
    # Rows in several lanes: each step's pieces joined in lane order (lanes are asked in
    # order, and each lane's parts are in step order).
    by_step: dict[int, list[pa.RecordBatch]] = {}
    for answer in answers:
        for run, _ in answer:
            for part in split_run(from_ipc(run)):
                by_step.setdefault(int(part.schema.metadata[b"global_step"]), []).append(part)
    steps = [join_parts(by_step[s]) for s in sorted(by_step)]
    runs = runs_of(steps, rank, world_size)
    return [to_ipc(run) for run, _ in runs], [n for _, n in runs]
