"""The rank protocol of the batch server (service/batch_server.py): what a trainer rank's
client (trainer/feed.py `Feed`) calls on it.

A rank says `hello` (joining the world, maybe resuming from a state), `beat`s while it trains,
asks for its rows with `get` (a long poll of at most `POLL_S`: rank r of W gets its rows
[r*G/W, (r+1)*G/W) of step s and up to `count` steps after it, as compact Arrow IPC in the
answer, or where the lanes hold them), reports its loss and data wait, and says `leave` when
it closes its feed. Ranks whose process ended (their Ray job gone) are marked left by `serve`
(`ranks_gone_with`); `drained` tells `serve` that every rank has had its end.

`RankDesk` holds these calls; the attributes are the server's (`BatchServer.__init__`). The
window of steps and ranks it reads and changes (`service/window.py` `StepWindow`: the world,
retention, flow control) is unit-tested without Ray; these calls are tested through the
server (tests/test_linger.py, tests/test_ranks.py, tests/test_liveness.py).
"""

from __future__ import annotations

import threading
import time

from service.sequence import Sequencing
from wire.arrays import to_ipc
from wire.protocol import (
    BEAT_S,
    LINGER_S,
    POLL_S,
    REPLY_BYTES,
    StepGone,
    StepReply,
    Welcome,
    is_int,
)


class RankDesk(Sequencing):
    """The calls of the ranks (concurrency groups `consumers`, `beats`, `reports`)."""

    _hungry: dict[int, bool]  # rank -> its last answer waited for the producer
    _rank_jobs: dict[int, str]  # rank -> its Ray job id (hello's `client`)
    _stop_now: bool
    _sent_lock: threading.Lock

    def hello(
        self, rank: int, world_size: int, state: dict | None = None, client: dict | None = None
    ) -> Welcome:
        """A rank joins (the first declares the world), optionally resuming from `state`.

        What cannot be served is refused before anything changes: a world size that does not
        divide G (so never more than G ranks, and rank-keyed state stays within G entries), a
        rank outside it, a state that is not an object. Only then may a resume restart the
        feed. `client`: the rank's Ray job id, so that `serve` keeps an embedded Ray up
        until that job has left (`rank_jobs`)."""
        self._check_world(world_size)
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is outside world size {world_size}")
        if state is not None and not isinstance(state, dict):
            from pipeline.state.resume import StateError

            raise StateError(f"resume state must be a JSON object, got {type(state).__name__}")
        if state is not None:
            self.seek(state)
        with self._cond:
            self.window.declare(rank, world_size, resuming=state is not None)
            job = (client or {}).get("job_id")
            if isinstance(job, str) and len(job) <= 64:  # recorded once the rank is admitted
                self._rank_jobs[rank] = job
            r = self.window.ranks[rank]
            if state is not None:  # it may have pulled past its checkpoint before it stopped
                r.next = min(r.next, int(state["step"]))
                r.asked = None
                r.consumed = None if r.consumed is None else min(r.consumed, r.next)
                first = int(state["step"])
            else:
                first = r.next
                policy = self.cfg.mixing.policy
                if policy is not None and first:  # it takes over where the service is
                    self.losses.joined_without_state(
                        rank, world_size, first, policy.every + policy.delay
                    )
            self._cond.notify_all()
            assert self.window.world is not None  # declare() above set it
            return Welcome(first, self.window.world, self.beat_s, self.generation)

    @property
    def beat_s(self) -> float:
        """How often a rank's client beats: well inside the timeout, at most every BEAT_S."""
        t = self.rank_timeout_s
        return BEAT_S if t is None else max(0.2, min(BEAT_S, t / 4))

    def beat(self, rank: int, world_size: int, consumed: int) -> bool:
        """A rank is alive and has consumed every step before `consumed` (its client's beat
        thread, group `beats`). False: it is not a rank of the world served (any more)."""
        with self._cond:
            ok = self.window.beat(rank, world_size, consumed)
            self._observe()
            return ok

    def leave(self, rank: int, world_size: int) -> bool:
        """A rank closed its feed (`Feed.close`): it holds no step back from now on, and the
        other ranks go on at once instead of waiting `rank_timeout_s` for it (service/window.py
        `leave`). False: not a rank of the world served."""
        with self._cond:
            ok = self.window.leave(rank, world_size)
            self._observe()
            self._cond.notify_all()
            return ok

    def ranks_gone_with(self, dead_jobs: list[str]) -> list[int]:
        """Ranks whose Ray job (their process's driver) has ended are marked left: a trainer
        killed, or one that exited without closing its feed, keeps no drain waiting. The
        ranks so marked."""
        dead = set(dead_jobs)
        with self._cond:
            world = self.window.world
            gone = [r for r, job in self._rank_jobs.items() if job in dead and world is not None
                    and not self.window.gone(r)]  # fmt: skip
            for r in gone:
                self.window.leave(r, world)  # type: ignore[arg-type]
            if gone:
                self._cond.notify_all()
            return gone

    def rank_jobs(self) -> list[str]:
        """The Ray job ids of the ranks that said hello (at most one per rank)."""
        with self._cond:
            return sorted(set(self._rank_jobs.values()))

    def drained(self) -> bool:
        """The data has ended and every rank of the world was told so (or is lost)."""
        with self._cond:
            return self._ended() and self.window.drained(self._stop_requested)

    def get(
        self,
        rank: int,
        world_size: int,
        step: int,
        wait_s: float = POLL_S,
        count: int = 1,
        generation: int | None = None,
    ) -> StepReply:
        """Rank `rank`'s rows of global steps `step`, `step + 1`, ... (up to `count`, and up to
        REPLY_BYTES of token ids), waiting at most `wait_s` for the first; joined into runs of
        one schema (StepReply).

        A rank that had to wait for the producer (in this call, or in its last) is a rank the
        producer cannot keep up with: it then lingers, at most LINGER_S, until `count` steps
        are there, like a Kafka fetch's `fetch.min.bytes` with `fetch.max.wait.ms`. Its wait
        over those steps is the same (it waits for the producer either way), and its calls are
        fewer. A rank that finds `count` steps ready, as one behind a slower GPU does, is
        answered at once and lingers no more.

        Why: a rank's cost, and the actor's, is mostly per call (Ray's RPC on both sides), on
        the cores that tokenize. Eight ranks consuming as fast as they can on 2 cores take
        ~26 steps per call this way and spend ~10 ms of CPU per global step with the actor;
        answered at once, 1 to 3 steps per call and ~26 ms (`python -m bench serving`)."""
        self._check_world(world_size)
        if generation is not None and generation != self.generation:
            raise StepGone(
                f"this service was restarted at step {self.window.start} by a rank resuming from "
                "a state after this rank connected; resume every rank from a saved state "
                "(Feed.connect(state=...)) so that all follow the same sequence"
            )
        G, L = self.cfg.global_batch_size, self.cfg.seq_len
        slice_bytes = -(-G // max(1, world_size)) * L * 4  # its rows of int32 token ids
        want = max(1, min(count, self.prefetch, REPLY_BYTES // slice_bytes))
        taken = self._take(rank, world_size, step, want, wait_s)
        if isinstance(taken, StepReply):  # none: its end, a stop, or a wait
            return taken
        return self._reply(taken, rank, world_size)

    def _take(self, rank: int, world_size: int, step: int, want: int, wait_s: float
              ) -> list | StepReply:  # fmt: skip
        """Rank `rank`'s steps from `step`, up to `want`, taken from the window once the first
        is there (waiting at most `wait_s`, lingering as `get` says), or the reply that says
        why none are: the end, a stop, or a wait."""
        deadline = time.monotonic() + max(0.0, min(wait_s, 30.0))
        linger_until: float | None = None  # set when a hungry rank's first step is there
        waited = self._hungry.get(rank, False)  # its last call waited for the producer
        with self._cond:
            while True:
                if self._stop_now:  # `stop --now`: a clean end at once, held steps or not
                    self.window.end(rank)
                    return StepReply("stopped")
                if waited and step in self.window.steps and not self._deliver_now(step, want):
                    linger_until = linger_until or time.monotonic() + LINGER_S
                    left = linger_until - time.monotonic()
                    if left > 0:
                        self.feed.ranks_behind = False  # it waits for the lanes' steps
                        self._linger_for[rank] = step + want
                        try:
                            self._lingering.wait(timeout=left)
                        finally:  # two calls of one rank may linger at once: one entry
                            self._linger_for.pop(rank, None)
                        continue
                batch = self.window.take(rank, world_size, step)
                if batch is not None:
                    self.window.ranks[rank].asked = step  # it has every step before this
                    batches = [batch]
                    while len(batches) < want and step + len(batches) in self.window.steps:
                        batches.append(self.window.take(rank, world_size, step + len(batches)))
                    self._hungry[rank] = waited and linger_until is not None
                    self._release_lanes()
                    self._cond.notify_all()  # the producer may have room now
                    return batches
                if self.producer.error:
                    raise RuntimeError(f"the feed failed: {self.producer.error}")
                if self._stop_requested:  # every step made before the stop was delivered
                    self.window.end(rank)
                    return StepReply("stopped")
                if self.producer.ended:
                    self.window.end(rank)
                    return StepReply("end")
                self.window.waits(rank)  # its wait for a step not made yet, from now
                left = deadline - time.monotonic()
                if left <= 0:
                    return StepReply("wait", reason=self._why_waiting())
                waited = True
                if not self.producer.paused:
                    self.feed.ranks_behind = False  # a rank waits for the lanes' steps
                self._cond.wait(timeout=min(left, 1.0))

    def _reply(self, batches: list, rank: int, world_size: int) -> StepReply:
        """The reply that gives rank `rank` its rows of the steps `batches` taken: where the
        lanes hold them, or the rows themselves."""
        from pipeline.feed import rank_runs
        from pipeline.lanes import where

        G = self.cfg.global_batch_size
        if self.feed.hold:  # the lanes hold the rows: where to take them
            return StepReply("ready", counts=[len(batches)],
                             lanes=where(batches, rank, world_size, G))  # fmt: skip
        # Sliced outside the lock: under it, one rank's copy held up every other rank.
        runs = rank_runs(batches, rank, world_size, G)
        payload = [to_ipc(run) for run, _ in runs]
        with self._sent_lock:
            self._sent[0] += sum(len(p) for p in payload)
            self._sent[1] += len(batches)
        return StepReply("ready", payload, [n for _, n in runs])

    def lane_handles(self, key: str) -> list:
        """The lane actors that a reply names by `key` (pipeline/lanes/steps.py `where`): the
        running feed's, or those of a feed a skip replaced whose steps ranks still take."""
        with self._cond:
            for feed in (self.feed, *(f for _, f in self._retired)):
                if feed.key is not None and feed.key == key:
                    return list(feed.handles)  # type: ignore[attr-defined]  # as they are now
        from wire.lane_rows import LaneGone

        raise LaneGone(
            f"the lanes named {key} are gone: a skip replaced them and they were closed once "
            "every live rank had their steps (a rank away past service.rank_timeout_s no "
            "longer holds them), or the service stopped"
        )

    def lane_gone(self, key: str, lane: int) -> list:
        """A rank met lane `lane` of the lanes named `key` gone (wire/lane_rows.py LaneGone): the
        running feed starts it again if its process died and it has restarts left
        (`service.lane_restarts`), and the rank gets the lanes' actors as they are now."""
        feed = self.feed
        if feed.key is not None and feed.key == key:
            feed.check_lane(lane)
        return list(self.lane_handles(key))

    def _release_lanes(self) -> None:
        """Under the lock: lanes that hold the rows (`lanes` > 1) may let go of the steps every
        live rank has fetched; lanes a skip replaced (`_retired`) close once none of their
        steps is needed."""
        holding = self.feed.hold  # lanes that keep the rows
        if not self._retired and not holding:
            return  # lanes: 1, nothing held elsewhere
        below = self.window.fetched_floor()
        if holding:
            self.feed.release(below)
        done = [feed for end, feed in self._retired if end <= below]
        if done:
            self._retired = [(end, feed) for end, feed in self._retired if end > below]
            for feed in done:  # off the lock: a lane's close is a call that may take a while
                threading.Thread(target=feed.close, daemon=True).start()

    def _deliver_now(self, step: int, want: int) -> bool:
        """May a hungry rank have `step` (produced) without lingering for more? (The window
        holds consecutive steps, up to the last produced.)"""
        ready = step + want <= self.window.produced
        return ready or self.producer.paused or self.producer.ended or self._stop_requested

    def _check_world(self, world_size: int) -> None:
        G = self.cfg.global_batch_size
        if not is_int(world_size) or world_size < 1 or G % world_size:
            raise ValueError(
                f"world size {world_size!r} does not divide global_batch_size {G}: "
                "every rank gets G/W rows of each step"
            )

    def report_loss(self, rank: int, world_size: int, step: int, losses: dict) -> None:
        """Rank `rank`'s loss per stream of global `step` (trainer.feed.stream_loss)."""
        with self._cond:
            if world_size != self.window.world or rank not in self.window.ranks:
                return  # not a rank of the world served: rank-keyed state stays bounded
            if not 0 <= int(step) < self.window.produced:
                raise ValueError(f"step {step} has not been produced")
        self.losses.add(rank, world_size, int(step), losses)
        if self.steering is not None:
            self.steering.reported()

    def report_wait(self, rank: int, seconds: float) -> None:
        if not (isinstance(seconds, int | float) and 0 <= seconds < 1e9):
            raise ValueError(f"data wait must be finite seconds >= 0, got {seconds!r}")
        with self._cond:
            if rank not in self.window.ranks:  # rank-keyed telemetry stays within the world
                return
        self.telemetry.report_wait(rank, seconds)
