"""A warm tokenizer pool: named, detached Ray actors that outlive one export.

Ray Data runs a job's tasks in that job's own worker processes. Every export against a
running cluster (`--address`) is a new job, so its workers start cold: each imports ray,
Ray Data, pyarrow and the pipeline and loads the tokenizer, ~4 CPU-seconds per worker here,
and on 2 cores the first block from the workers came 7 s after Ray was connected. The
hand-written script a user compares us with forks its workers with the tokenizer already in
memory.

When `tokenmill export` joins a running cluster (`--address`, RAY_ADDRESS; `--pool 0` opts
out), or with `--pool N`, units go instead to actors (by default as many as the cluster has
CPUs) named `tokenmill-tokenize-<code>-<i>` in the `tokenmill` namespace, created by the first
export that asks and kept for `idle_s` seconds after the last export using them lets go (then
they exit and give their memory back; `TokenizeWorker`). Not with a private local Ray: it ends
with the export. A later export finds them warm: imports done, tokenizer loaded. `<code>` is a
digest of the pipeline's source files, so an export never uses workers that run other code
than its own.

The blocks are the same as Ray Data's (the same `tokenize_unit_json` body, one block per
unit, in unit order), so exports are byte-identical either way.

Trade-off: the actors reserve no CPUs. Reserving one each would keep Ray Data tasks of every
other job (a plain export, a service) waiting until the pool idled out; unreserved, an idle
pool costs nothing but memory, and a busy one shares the cores with whatever else runs.
Size it to the cores it should use (`--pool N`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa

from client.cluster import jobs_alive
from pipeline.config import REVEAL_SECRETS, StreamConfig, TokenizerConfig
from pipeline.read.reading import Executor, Prefetcher, Unit, tokenize_unit_json

NAMESPACE = "tokenmill"
IN_FLIGHT_PER_ACTOR = 2  # units queued per actor: one running, one waiting
GROW_EVERY_S = 10.0  # how often a pool that follows the cluster's CPUs looks for more
RETRIES = 3  # a unit whose actor died is asked of a new one up to this many times


@functools.cache
def code_digest() -> str:
    """A digest of this package's source: actors of other code are never used."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(path.relative_to(Path(__file__).parent).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _name(i: int) -> str:
    return f"tokenmill-tokenize-{code_digest()}-{i}"


class TokenizeWorker:
    """One warm process: tokenizes units for the exports that hold it; exits `idle_s` seconds
    after the last of them lets go.

    Why holds and not an idle timer alone: an export asks an actor for its next units only
    once it has the blocks before, so while it waits on a slower actor (the first unit loads
    the tokenizer; a loaded node slows any) the others hear nothing from it. Ray runs its
    workers at niceness 15: beside a user's own work on the same cores a call took over 20 s
    to reach an actor here, longer than any idle time a pool can afford, so no message from
    the export can tell a starved actor from an idle one. A hold can: each export holds the
    actor from its first call (or from creating it) until it lets go (`release`, after its
    last unit), and a hold whose job's driver is gone (killed: no release comes) is dropped
    by the GCS's job table. The idle time counts only while nothing holds the actor.

    Threads: Ray runs the actor's calls one at a time (no concurrency groups); its idle thread
    reads `holds` and `last` under `lock`. The tokenizer is the process-wide `load_tokenizer`
    one, keyed by the tokenizer file's content, so a file rewritten between two exports is not
    encoded with the old one.
    """

    def __init__(self, idle_s: float, holder: tuple[str, str]):
        self.idle_s = idle_s
        self.lock = threading.Lock()
        self.holds: dict[str, str] = {}  # an export's token -> its job's id
        self.last = time.monotonic()
        self._hold(holder)
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def _hold(self, holder: tuple[str, str]) -> None:
        token, job = holder
        with self.lock:
            self.holds[token] = job
            self.last = time.monotonic()

    def _held(self) -> bool:
        with self.lock:
            holds = dict(self.holds)
        if not holds:
            return False
        try:
            alive = jobs_alive()
        except Exception:  # the GCS out of reach for a moment: keep the holds
            return True
        with self.lock:
            for token, job in holds.items():
                if not alive.get(job, False):
                    self.holds.pop(token, None)
            return bool(self.holds)

    def _exit_when_idle(self) -> None:
        while self._held() or time.monotonic() - self.last < self.idle_s:
            time.sleep(min(5.0, self.idle_s))
        os._exit(0)  # detached: nothing else ends it; Ray frees the name

    def ready(self) -> int:
        """Keep warm a while longer; the process id (a test checks it is reused)."""
        with self.lock:
            self.last = time.monotonic()
        return os.getpid()

    def release(self, token: str) -> None:
        """The export `token` asks nothing more of this actor; its idle time begins."""
        with self.lock:
            self.holds.pop(token, None)
            self.last = time.monotonic()

    def tokenize(self, unit: str, stream: dict, tokenizer: dict, holder: tuple[str, str]) -> pa.Table:  # fmt: skip
        self._hold(holder)
        return tokenize_unit_json(unit, stream, tokenizer)


def _actor(i: int, idle_s: float, holder: tuple[str, str]):
    import ray

    # No CPUs reserved (see module), spread over the nodes as Ray Data's tasks would be.
    cls = ray.remote(num_cpus=0, max_restarts=0)(TokenizeWorker)
    return cls.options(
        name=_name(i),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy="SPREAD",
    ).remote(idle_s, holder)


def _pool_blocks(units: list[Unit], stream: StreamConfig, tok_cfg: TokenizerConfig,
                 size: int | None, idle_s: float, ready: Future | None) -> Iterator[pa.Table]:  # fmt: skip
    if ready is not None:
        ready.result()  # Ray connects in the background (client/cluster.py)
    import ray

    if not units:
        return
    # This export's hold on the actors it asks (TokenizeWorker): a token of its own, and its
    # job, whose end drops the hold should the release never come.
    holder = (uuid.uuid4().hex, ray.get_runtime_context().get_job_id())
    follow = size is None  # as many as the cluster has CPUs: more when nodes join
    # No more actors than units: an actor without a unit would only cost a process.
    count = max(1, min(_size(size), len(units)))
    actors = [_actor(i, idle_s, holder) for i in range(count)]
    try:
        yield from _blocks(units, stream, tok_cfg, actors, follow, idle_s, holder)
    finally:
        for actor in actors:  # `actors` as _blocks left it (grown, dead ones replaced)
            with contextlib.suppress(
                Exception
            ):  # Ray gone with the driver: its job's end drops the hold
                actor.release.remote(holder[0])


def _blocks(units: list[Unit], stream: StreamConfig, tok_cfg: TokenizerConfig, actors: list,
            follow: bool, idle_s: float, holder: tuple[str, str]) -> Iterator[pa.Table]:  # fmt: skip
    import ray

    looked = time.monotonic()
    stream_json = stream.model_dump(mode="json", context=REVEAL_SECRETS)
    tok_json = tok_cfg.model_dump(mode="json")

    def submit(k: int):
        actor = actors[k % len(actors)]
        return actor.tokenize.remote(units[k].to_json(), stream_json, tok_json, holder)

    pending: collections.deque = collections.deque()
    nxt = 0
    for k in range(len(units)):
        if follow and time.monotonic() - looked >= GROW_EVERY_S:
            # Nodes an autoscaler added (service.autoscale asks for them while ranks wait):
            # their CPUs tokenize from now on, not from the next pass. Any actor makes any
            # unit's block alike, so the blocks do not change.
            looked = time.monotonic()
            while len(actors) < min(_size(None), len(units)):
                actors.append(_actor(len(actors), idle_s, holder))
        while nxt < len(units) and nxt < k + len(actors) * IN_FLIGHT_PER_ACTOR:
            pending.append(submit(nxt))
            nxt += 1
        ref = pending.popleft()
        for attempt in range(RETRIES + 1):
            try:
                block = ray.get(ref)
                break
            except ray.exceptions.RayActorError:
                # An idle actor exited between lookup and call (or died): a new one, held by
                # this export from its creation, does the unit. The name may still find the
                # exiting actor for a moment (the GCS frees it once the process is gone), so
                # a few tries, 0, 1 and 2 s apart.
                if attempt == RETRIES:
                    raise
                time.sleep(attempt)
                actors[k % len(actors)] = _actor(k % len(actors), idle_s, holder)
                ref = submit(k)
        yield block


def _size(size: int | None) -> int:
    """A pool's size: `size`, else as many actors as the cluster has CPUs (as Ray Data)."""
    import ray

    return size if size is not None else max(1, int(ray.cluster_resources().get("CPU", 1)))


def pool_is_warm(size: int | None) -> bool:
    """Whether every actor of a pool of `size` is up (an earlier export's or service's, of
    this code): then it makes a feed's first units from the start, its imports done, with no
    head start in the feed's process (service/batch_server.py). Ray must be connected."""
    import ray

    for i in range(_size(size)):
        try:
            ray.get_actor(_name(i), namespace=NAMESPACE)
        except ValueError:
            return False
    return True


class PoolExecutor:
    """An executor over a warm pool of `size` tokenizer actors (None: the cluster's CPUs; see
    module); with `ready`, its executions wait for Ray to be connected."""

    startup_s = 1.0  # to its first block, for the head start (warm: 1.1-1.5 s on 8 MB units)
    tokenizes_here = False  # a StepFeed whose first units it makes loads its tokenizer on a thread

    def __init__(self, size: int | None, idle_s: float = 300.0, ready: Future | None = None):
        self.size, self.idle_s, self.ready = size, idle_s, ready

    def __call__(self, units: list[Unit], stream: StreamConfig, tok_cfg: TokenizerConfig):
        blocks = functools.partial(
            _pool_blocks, units, stream, tok_cfg, self.size, self.idle_s, self.ready
        )
        return Prefetcher(blocks, 2)


def pool_executor(size: int | None, idle_s: float = 300.0, ready: Future | None = None) -> Executor:
    return PoolExecutor(size, idle_s, ready)
