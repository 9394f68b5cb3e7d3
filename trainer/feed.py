"""The trainer's feed client: pull this rank's batches from a tokenmill service.

    feed = Feed.connect(service="tokenmill", rank=r, world_size=w)
    for batch in feed:            # dict of torch tensors [B, L], plus seq_lens and global_step
        ...
        feed.report_wait(seconds)
    state = feed.state_dict()     # store in the checkpoint; Feed.connect(..., state=state) resumes

Finding the service: `address` if given, else the service's record on this machine (what
`tokenmill serve --name N` wrote, as `tokenmill status` finds it), else RAY_ADDRESS, else the
one Ray cluster running here (`client.cluster.client_address`).

Liveness: a thread beats every few seconds with the step this rank has consumed, so a rank
that trains slowly on the steps it fetched (up to 32 per call) is never declared lost; only
one with no sign of life for `service.rank_timeout_s` (a killed process) is. At the end of
the data every rank receives every step, then `StopIteration`.

The first rank to connect declares the world size; the service holds every step until all
ranks of that world have taken it, so ranks may connect in any order, minutes apart, and pull
several micro-steps ahead of one another (gradient accumulation). While the step it asks for
waits on other ranks or on a pause, a rank waits as long as the service is alive; it raises
`FeedError` when the service is gone or stopped (within seconds), failed, or does not produce
the step within `timeout_s` although nothing holds it back.

Batches arrive in the compact layout (wire/layout.py: no column that `input_ids` and
`seq_lens` determine), up to 32 steps in the answer to one call, as runs: one Arrow record
batch holding this rank's rows of consecutive steps (protocol.StepReply). The rank derives
`labels`, `position_ids` and `segment_ids` straight into int64 and copies each stored column
once, a few steps per pass (`to_torch_steps`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from wire.protocol import (
    BEAT_GROUP,
    CONSUMER_GROUP,
    CONTROL_GROUP,
    IGNORE_LABEL,
    LOOKAHEAD,
    META_GLOBAL_STEP,
    META_STEP_ROWS,
    NAMESPACE,
    POLL_S,
    REPORT_GROUP,
    SERVICE_NAME,
    check_service_name,
)

_CONNECT_LOCK = threading.Lock()
_FEEDS: weakref.WeakSet = weakref.WeakSet()  # open feeds, whose beat threads stop at exit


def stop_beats(timeout_s: float = 1.0) -> None:
    """Stop every feed's beat thread and wait for it (briefly): before Ray shuts down, so no
    thread calls into a Ray that is going away (at interpreter exit this runs before Ray's
    own shutdown: atexit hooks run last-registered first)."""
    for feed in list(_FEEDS):
        feed._beating.set()
    for feed in list(_FEEDS):
        if feed._beater is not None:
            feed._beater.join(timeout_s)


atexit.register(stop_beats)


def _goodbye() -> None:
    """At exit, every feed still open says goodbye (`Feed.close`): a trainer that ends without
    closing its feed holds no step back and keeps no drain (`tokenmill stop`) waiting. Runs
    before `stop_beats` and Ray's own shutdown (atexit: last registered, first run)."""
    for feed in list(_FEEDS):
        if feed.server is not None and not feed._ended:
            with contextlib.suppress(Exception):
                feed.close()


atexit.register(_goodbye)


class FeedError(RuntimeError):
    """The service is gone, stopped, failed, or does not answer."""


# Tokens decoded in one pass (a few steps; a larger step is one pass). A whole 32-step run at
# once allocated ~14 MB per answer, all alive until its last step was consumed; a pass keeps
# ~2 MB alive, and still spreads numpy's per-call cost (~180 us per step of 4 x 2048 tokens
# decoded alone, ~50 us in a pass) over several steps.
DECODE_TOKENS = 1 << 16


def to_torch_steps(batch) -> Iterator[dict]:
    """A run of steps (protocol.StepReply: one record batch of either layout, META_STEP_ROWS
    rows after rows) as one dict per step: int64 tensors [rows, L], its seq_lens and global
    step. The compact layout's derived columns are computed here, straight into numpy, a
    few steps per pass (DECODE_TOKENS), each pass when its first step is asked for: the
    memory of the steps consumed before is free again by then. Each stored column is copied
    once, and a step's tensors are views of its pass's (contiguous rows)."""
    import torch

    from wire.layout import tensor_columns

    n = batch.num_rows
    L = batch.column("input_ids").type.list_size
    meta = batch.schema.metadata or {}
    first = int(meta.get(META_GLOBAL_STEP, b"-1"))
    rows = [int(r) for r in meta[META_STEP_ROWS].split(b",")] if META_STEP_ROWS in meta else [n]
    lens = batch.column("seq_lens").to_pylist()
    streams = batch.column("stream").to_pylist()
    at, i = 0, 0
    while i < len(rows):
        j, m = i + 1, rows[i]  # steps i..j-1, m rows, in this pass
        while j < len(rows) and (m + rows[j]) * L <= DECODE_TOKENS:
            m, j = m + rows[j], j + 1
        part = batch.slice(at, m)
        cols = {  # the derived columns are made in int64, the stored ones copied once
            name: torch.from_numpy(flat.reshape(m, L).astype(np.int64, copy=False))
            for name, flat in tensor_columns(part, np.int64).items()
        }
        a = 0
        for k in range(i, j):
            step = {name: t[a : a + rows[k]] for name, t in cols.items()}
            step["seq_lens"] = lens[at + a : at + a + rows[k]]
            step["stream"] = streams[at + a : at + a + rows[k]]
            step["global_step"] = first + k
            a += rows[k]
            yield step
        at, i = at + m, j


# A reported loss's resolution (2**-20, ~1e-6: float32's own at a loss of ~8). A step's sum is
# exact below 2**33 (53 bits less 20): ~1e9 tokens at a loss of 8.
LOSS_QUANTUM = 2.0**-20


def stream_loss(batch: dict, token_loss) -> dict[str, list[float]]:
    """Per stream, [summed loss, labelled tokens] of one batch: what `Feed.report_loss` takes.

    `token_loss`: the per-token loss the trainer already has, [B, L - 1] with HF's shift
    (`token_loss[:, t]` is the loss of predicting `labels[:, t + 1]`; e.g. cross entropy with
    `reduction="none"` over `logits[:, :-1]`), or [B, L] aligned with `labels`. Only tokens
    whose label is not -100 count. A label's token belongs to the segment it sits in, and a
    segment's first label is always -100, so a loss is never credited across documents."""
    import torch

    labels = batch["labels"]
    B, L = labels.shape
    tl = token_loss.detach().float().reshape(B, -1).to(labels.device)
    if tl.shape[1] == L - 1:
        tl = torch.nn.functional.pad(tl, (1, 0))
    if tl.shape[1] != L:
        raise ValueError(f"token_loss has shape {tuple(token_loss.shape)}; want [{B}, {L - 1}]")
    names = sorted({name for row in batch["stream"] for name in row})
    code = torch.full((B, L), -1, dtype=torch.long)
    for r, (lens, row) in enumerate(zip(batch["seq_lens"], batch["stream"], strict=True)):
        idx = torch.tensor([names.index(n) for n in row], dtype=torch.long)
        n = int(sum(lens))
        code[r, :n] = torch.repeat_interleave(idx, torch.tensor(lens, dtype=torch.long))
    code = code.to(labels.device)
    counted = labels != IGNORE_LABEL
    # Fixed point: each token's loss rounded to a multiple of LOSS_QUANTUM and summed as
    # integers, so a sum is exact and the same however the rows are split among ranks (a float
    # sum's last bits follow the split, and the policy's decisions followed them). The floats
    # sent are exact multiples of the quantum, which the service adds exactly too.
    fixed = torch.round(tl.double() / LOSS_QUANTUM).to(torch.int64)
    out = {}
    for c, name in enumerate(names):
        m = counted & (code == c)
        out[name] = [int(fixed[m].sum()) * LOSS_QUANTUM, int(m.sum())]
    return out


class Feed:
    # Steps fetched per call, at most (the service's prefetch window caps it, and so does
    # protocol.REPLY_BYTES). A rank's cost is mostly per call (Ray's RPC on both sides), so a
    # hungry rank takes up to this many in one answer (BatchServer.get lingers for them).
    LOOKAHEAD = LOOKAHEAD

    def __init__(self, server, rank: int, world_size: int, step: int, timeout_s: float):
        self.server, self.rank, self.world_size = server, rank, world_size
        self.step = step  # the next step this rank consumes
        self.timeout_s = timeout_s
        self.lookahead = self.LOOKAHEAD
        self._ahead: Iterator[dict] = iter(())  # fetched, not yet consumed: self.step, ...
        self.calls = 0  # `get` calls made (a rank's cost is mostly per call, not per step)
        self.generation: int | None = None  # the sequence joined (protocol.Welcome)
        self._left = False  # said goodbye (`close`)
        self._beating = threading.Event()  # set: the beat thread stops
        self._beater: threading.Thread | None = None
        self._beat_s = 5.0
        self._lanes: Any = None  # lane actors by their feed's key (wire/lane_rows.py LaneActors)
        # Told the end: later `next` calls stop here, without asking a service that may have
        # gone (HF's Trainer iterates again after the end); the state after the last step is
        # kept for a final checkpoint.
        self._ended = False
        self._final_state: dict | None = None

    def _start_beats(self, every_s: float) -> None:
        """Beat from a daemon thread every `every_s` with the step this rank has consumed.

        The thread reads `self.step` (an int the training thread rebinds; a stale read only
        reports one step less) and owns nothing else. It ends on `close`, at the end of the
        data, or when Ray is gone; a beat is fire-and-forget, so a slow service never holds
        the thread up, and a training step never waits on a beat. A beat the service does not
        take (a world being re-declared by a resume) is no reason to stop: the next one is."""
        self._beat_s = every_s
        if self._beater is not None and self._beater.is_alive():
            return
        self._beating = stop = threading.Event()
        server, rank, world = self.server, self.rank, self.world_size
        beat = server.beat.options(concurrency_group=BEAT_GROUP)

        import ray

        def run() -> None:
            while not stop.wait(every_s):
                if not ray.is_initialized():  # shut down under us: nothing to beat to
                    return
                try:
                    beat.remote(rank, world, self.step)
                except Exception:  # Ray is gone: the rank's own calls will say so
                    return

        _FEEDS.add(self)

        self._beater = threading.Thread(target=run, name=f"tokenmill-beat-{rank}", daemon=True)
        self._beater.start()

    @classmethod
    def connect(cls, service: str = SERVICE_NAME, rank: int = 0, world_size: int = 1,
                address: str | None = None, state: dict | None = None,
                timeout_s: float = 60.0) -> Feed:  # fmt: skip
        """Join the service's cluster (`address`, else the service's record on this machine,
        else RAY_ADDRESS, else the one Ray cluster running here) and say hello as rank `rank`
        of `world_size`; beats start (see the module's docstring)."""
        import ray

        from client.cluster import connect, wait_for_cluster

        check_service_name(service)
        deadline = time.time() + timeout_s
        with _CONNECT_LOCK:  # ranks may be threads of one process (tests, simulators)
            if not ray.is_initialized():
                connect(wait_for_cluster(address, service, deadline))
                # Ray builds its serializer on a process's first object (~0.2 CPU-s: it
                # imports pydantic): here, while the service may still be starting, not in
                # the first call to it.
                ray.put(None)
        while True:
            try:
                server = ray.get_actor(service, namespace=NAMESPACE)
                break
            except ValueError:
                if time.time() > deadline:
                    raise FeedError(
                        f"no tokenmill service named {service!r} within {timeout_s}s"
                    ) from None
                time.sleep(0.1)  # the service may be starting: a rank waits for it
        feed = cls(server, rank, world_size, 0, timeout_s)
        client = {"job_id": ray.get_runtime_context().get_job_id()}
        welcome = feed._call("hello", rank, world_size, state, client, group=CONSUMER_GROUP)
        feed.step, feed.generation = welcome.step, welcome.generation
        feed._start_beats(welcome.beat_s)
        return feed

    def _call(self, method: str, *args, group: str = CONTROL_GROUP, timeout_s: float | None = None):
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        fn = getattr(self.server, method).options(concurrency_group=group)
        try:
            return ray.get(fn.remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise FeedError(
                f"the tokenmill service did not answer {method} within {timeout_s:.0f}s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError) as e:
            raise FeedError(f"the tokenmill service is gone: {type(e).__name__}") from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise FeedError(str(cause or e)) from None

    def __iter__(self):
        return self

    def rejoin(self, state: dict) -> None:
        """Continue from `state` as the same rank (the service seeks there if it must); the
        next step is the one that followed it. Beats go on, or start again after an end."""
        welcome = self._call("hello", self.rank, self.world_size, state, group=CONSUMER_GROUP)
        self.step, self._ahead = welcome.step, iter(())
        self.generation = welcome.generation
        self._ended, self._final_state = False, None
        self._start_beats(welcome.beat_s)

    @property
    def ended(self) -> bool:
        """Told the end (of the data, or a `tokenmill stop`): the next `next` stops."""
        return self._ended

    def __next__(self) -> dict:
        from wire.arrays import from_ipc

        if self._ended:
            raise StopIteration
        step = next(self._ahead, None)
        if step is None:
            runs = self._fetch()
            self._ahead = itertools.chain.from_iterable(
                to_torch_steps(from_ipc(run)) for run in runs
            )
            step = next(self._ahead)
        self.step += 1
        return step

    def _fetch(self) -> list:
        """This rank's next steps: at least one, up to LOOKAHEAD if they are produced."""
        producing_since, told = None, time.time()
        while True:
            self.calls += 1
            reply = self._call("get", self.rank, self.world_size, self.step, POLL_S,
                               self.lookahead, self.generation, group=CONSUMER_GROUP,
                               timeout_s=self.timeout_s + POLL_S)  # fmt: skip
            if reply.ready:
                break
            if reply.status in ("end", "stopped"):
                # Told the end (of the data, or `tokenmill stop`: every step made before it
                # was delivered first, unless `--now`): keep the final state (its checkpoint
                # may come after `serve` has gone), then nothing holds this rank any more.
                if reply.status == "stopped":
                    print(f"tokenmill: rank {self.rank}: the service was stopped; the feed ends "
                          f"at step {self.step}", file=sys.stderr, flush=True)  # fmt: skip
                try:
                    self._final_state = self._state()
                except FeedError:
                    self._final_state = None
                self._ended = True
                self._beating.set()
                raise StopIteration
            # `wait`: held back by other ranks or a pause (wait on), or still producing.
            now = time.time()
            if reply.reason == "producing":
                producing_since = producing_since or now
                if now - producing_since > self.timeout_s:
                    raise FeedError(f"step {self.step} was not produced within {self.timeout_s}s")
            else:
                producing_since = None
            if now - told > 60:
                told = now
                print(f"tokenmill: rank {self.rank} waits for step {self.step}: {reply.reason}",
                      file=sys.stderr, flush=True)  # fmt: skip
        if not reply.lanes:
            return list(reply.runs)
        from wire.lane_rows import LaneActors, LaneGone, fetch_again

        if self._lanes is None:  # the lane actors, asked of the server once per sequence
            self._lanes = LaneActors(
                lambda key: self._call("lane_handles", key, group=CONSUMER_GROUP)
            )
        try:  # the lanes hold the rows (`lanes` > 1): taken from them straight, and from a
            # lane's new actor when its process died (`service.lane_restarts`)
            return fetch_again(
                reply.lanes, self.rank, self.world_size, self.timeout_s, self._lanes,
                lambda key, lane: self._call("lane_gone", key, lane, group=CONSUMER_GROUP),
            )[0]  # fmt: skip
        except (LaneGone, LookupError, TimeoutError, FeedError) as e:
            raise FeedError(f"step {self.step}: {e}") from None
        except Exception as e:  # any other failure of a lane's answer, named
            raise FeedError(
                f"step {self.step}: taking rows from a lane: {type(e).__name__}: {e}"
            ) from None

    def report_loss(self, step: int, losses: dict[str, list[float]]) -> None:
        """Global step `step`'s loss per stream on this rank (`stream_loss`), fire and forget:
        the service joins the ranks' reports per step (metrics, page, the mixing policy)."""
        if self.server is None:
            return
        fn = self.server.report_loss.options(concurrency_group=REPORT_GROUP)
        fn.remote(self.rank, self.world_size, int(step), losses)

    def report_wait(self, seconds: float) -> None:
        fn = self.server.report_wait.options(concurrency_group=REPORT_GROUP)
        fn.remote(self.rank, float(seconds))  # fire and forget

    def state_dict(self) -> dict:
        """The feed state after the last step this rank consumed (same on every rank); after
        the end, the state after the last step, kept when the end came."""
        if self._ended and self._final_state is not None:
            return self._final_state
        return self._state()

    def _state(self) -> dict:
        # Under the mixing policy the state waits for the other ranks' loss of the steps
        # before it: within this call's own timeout, so that the service never waits longer
        # for an answer nobody takes.
        return self._call("state", self.step, max(1.0, self.timeout_s - 5))

    def close(self) -> None:
        """Stop beating and say goodbye: the service stops holding steps back for this rank
        at once (the other ranks go on), instead of after `rank_timeout_s`. Idempotent; a
        service already gone is no error."""
        self._beating.set()
        server, self.server = self.server, None
        if server is None or self._left:
            return
        self._left = True
        import ray

        try:
            if ray.is_initialized():
                fn = server.leave.options(concurrency_group=BEAT_GROUP)
                ray.get(fn.remote(self.rank, self.world_size), timeout=5)
        except Exception:  # the service ended, or Ray is gone: nothing holds steps for us
            pass
