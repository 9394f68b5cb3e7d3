"""The batch server: the Ray actor that owns the feed and hands out batches.

Ray-free parts do the work, each unit-tested on its own:
- `window.StepWindow`: the world, retention (a step is held until every rank of the world has
  taken it) and flow control (at most `prefetch` steps ahead of the slowest live rank);
- `producer.Producer`: the deterministic StepFeed on a thread, one step at a time, into the window;
- `telemetry.Telemetry`: throughput history, data wait per rank, the rejects buffer;
- `autoscale.Autoscaler` (with `service.autoscale`): a thread that asks the cluster for CPUs
  while the ranks wait (the rule: `demand.Demand`).

Two parts of the class live in their own modules: `sequence.Sequencing` (the step source
built, installed, sought by a resume, changed by a skip, steps made recomputed) and
`server_view.ServerView` (status, metrics, the producer's state, a stall).

This class joins them under one condition variable and adds what needs Ray: rank r of W asks
for step s (and up to `count` steps after it) and gets its rows [r*G/W, (r+1)*G/W) of each, as
compact Arrow IPC inside the call's answer (protocol.StepReply). Requests are long polls of at
most `POLL_S` seconds (StepReply `wait`), so a blocked rank holds a thread of the `consumers`
group only briefly, the server notices a rank that stopped asking, and the API (group
`control`) always has threads of its own.

The actor is not detached: it lives as long as the process that started it (`tokenmill serve`,
or the Ray job), so a killed `serve` never leaves a service behind that blocks the next one.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from typing import TYPE_CHECKING

from service.losses import StreamLosses
from service.sequence import Sequencing
from wire.arrays import to_ipc
from wire.protocol import (
    BEAT_S,
    LINGER_S,
    LOOKAHEAD,
    POLL_S,
    REPLY_BYTES,
    STOPPING,
    WINDOW_BYTES,
    WINDOW_STEPS,
    StepGone,
    StepReply,
    Welcome,
    is_int,
)

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.feed import LeaveOut, StepSource

# The pipeline is imported where it is used, not here: a rank's `ray.get_actor` loads this
# class, so every rank imports this module too (with the pipeline and pydantic, that cost
# each rank ~0.37 CPU-s at connect, on the cores the service was starting on).


def _quietly(fn, *args) -> None:
    """`fn(*args)` for its side effect (a cache), on a thread: an error is raised again where
    the result is needed (the same call, in the feed), not here."""
    with contextlib.suppress(Exception):
        fn(*args)


class _Default(enum.Enum):
    """A sentinel type: `rank_timeout_s` None means no timeout, so "not given" needs its own."""

    TOKEN = 0


_DEFAULT = _Default.TOKEN


def prefetch_window(cfg: Config) -> int:
    """The window's length in global steps: `service.prefetch`, else WINDOW_STEPS (32), or
    LOOKAHEAD (64) when the lanes hold the rows (`lanes` > 1), so that a hungry rank can take
    that many in one call; unless the window would then hold more than WINDOW_BYTES of token
    ids (a step of G x L int32: here, or in the lanes), and never fewer than 8."""
    if cfg.service.prefetch is not None:
        return cfg.service.prefetch
    step_bytes = cfg.global_batch_size * cfg.seq_len * 4
    steps = LOOKAHEAD if cfg.lanes > 1 else WINDOW_STEPS
    return max(8, min(steps, WINDOW_BYTES // step_bytes))


class BatchServer(Sequencing):
    def __init__(
        self,
        cfg_json: dict,
        state: dict | None = None,
        prefetch: int | None = None,
        keep_states: int = 10_000,
        rank_timeout_s: float | None | _Default = _DEFAULT,
        allow_config_change: bool = False,
        pool: bool = False,
        leave_out: LeaveOut | None = None,
    ):
        from pipeline.config import Config
        from pipeline.tokenize import load_tokenizer

        self.cfg = Config.model_validate(cfg_json)
        # The tokenizer loads (~0.6 s; its parse lets go of the GIL) while the rest of the
        # pipeline is imported and planned; the feed finds it loaded or waits for it.
        threading.Thread(target=_quietly, args=(load_tokenizer, self.cfg.tokenizer),
                         name="tokenmill-tokenizer", daemon=True).start()  # fmt: skip
        from service.telemetry import Telemetry

        self.pool = pool  # tokenize on the warm pool (a running cluster), else Ray Data
        self.prefetch = max(1, prefetch or prefetch_window(self.cfg))
        self.keep_states = keep_states
        self.rank_timeout_s = (
            self.cfg.service.rank_timeout_s if rank_timeout_s is _DEFAULT else rank_timeout_s
        )
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # Hungry ranks linger here (get), woken only when the steps they wait for are made
        # (_on_step): on the shared condition, every step woke every lingering rank.
        self._lingering = threading.Condition(lock)
        self._linger_for: dict[int, int] = {}  # rank -> the step count (produced) it waits for
        self.telemetry = Telemetry()
        policy = self.cfg.mixing.policy
        # The policy reads windows up to every + delay steps back (and a state carries them).
        keep = 4096 if policy is None else max(4096, 2 * (policy.every + policy.delay))
        self.losses = StreamLosses(list(self.cfg.streams), keep=keep)
        self.steering = None
        if policy is not None:
            from service.steering import Steering

            self.steering = Steering(self.cfg, self.losses, self._cond)
        self._started = time.time()
        self._stop_requested = False
        self._stop_now = False  # `stop --now`: held steps are not delivered either
        self._owner: dict = {}
        self._seek_lock = threading.Lock()  # ranks resuming together restart the feed once
        self._seeked: dict | None = None
        self._hungry: dict[int, bool] = {}  # rank -> its last answer waited for the producer
        # Token rows this process has sent ranks, as Arrow IPC bytes, and the rank-steps they
        # held: with `lanes` > 1 none (the ranks take their rows from the lanes; metrics
        # `control_row_bytes`, bench/nodes.py), with `lanes: 1` every row.
        self._sent = [0, 0]
        self._sent_lock = threading.Lock()
        self._rank_jobs: dict[int, str] = {}  # rank -> its Ray job id (hello's `client`)
        self._observed: tuple[float, str] = (0.0, "")  # when and what `_observe` last kept
        self._replaying = threading.Lock()  # one provenance replay at a time (`provenance`)
        self._control = threading.Lock()  # one change of course at a time (`_controlled`)
        # Laned feeds a skip replaced, with the first step they did not make: their lanes
        # hold rows of the steps before it until every rank has fetched them.
        self._retired: list[tuple[int, StepSource]] = []
        self.demand = None
        self._scaler = None
        self._start_feed(state, allow_config_change, leave_out)
        scale = self.cfg.service.autoscale
        if scale is not None:  # after the feed: a refused state leaves no thread behind
            from service.autoscale import Autoscaler, coordinator_place
            from service.demand import Demand

            self.demand = Demand(scale.max_cpus, scale.up_wait, scale.cooldown_s)
            tel, requester = self.telemetry, f"tokenmill-{os.getpid()}-{id(self)}"
            self._scaler = Autoscaler(
                self.demand,
                waits=lambda: {r: s for r, (s, _) in tel.wait_by_rank().items()},
                observed=lambda: [
                    (o["t"], o["producer"]) for o in tel.observations_view(last=3600)
                ],
                place=lambda: coordinator_place(requester),
            )

    # -- production -------------------------------------------------------------------------

    def _start_feed(self, state: dict | None, allow_config_change: bool = False,
                    leave_out: LeaveOut | None = None) -> None:  # fmt: skip
        carried = self._carried(state)
        feed = self._make_feed(state, allow_config_change, leave_out)
        self.losses.carry(carried, feed.step)
        self._install(feed)

    # -- consumers (concurrency group `consumers`) --------------------------------------------

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

    def state(self, step: int | None = None, wait_s: float | None = None) -> dict:
        """The state at `step` (default: the newest made; under the mixing policy, the newest
        whose carried loss is complete, as the ranks train behind the steps made). Under the
        policy it carries the loss its resume decides from, waited for: up to `wait_s` (the
        API's), else up to `mixing.policy.wait_s` (a rank's, at the step it is about to
        train)."""
        with self._cond:
            states = self.producer.states
            if step is None and self.steering is not None:
                step = next((s for s in reversed(states) if self.steering.complete(s)),
                            next(iter(states)))  # fmt: skip
            step = max(states) if step is None else step
            if step not in states:
                held = f"{next(iter(states))}..{max(states)}" if states else "none"
                raise StepGone(f"no state for step {step} (states held: {held})")
            kept = states[step]
            producer = self.producer
        state = kept.unpack()
        if self.steering is not None:  # with the loss its resume decides from
            return self.steering.attach(state, step, lambda: producer.stopping, wait_s)
        return state

    # -- control (concurrency group `control`) ------------------------------------------------

    def set_weights(self, weights: dict[str, float]) -> int:
        """New weights, effective at the first step whose production has not begun."""
        missing = sorted(set(self.cfg.streams) - set(weights))
        if missing:
            raise ValueError(
                f"weights must name every stream; missing: {', '.join(missing)} "
                f"(streams: {', '.join(self.cfg.streams)})"
            )
        with self._controlled(), self._cond:
            # The first step whose production has not begun; it changes only under this lock
            # (feed.step moves inside next_step, outside it), so concurrent calls agree and
            # the schedule never goes backwards, also across the end of the data.
            # Lanes confirm it as they come to it (`wait=False`); a StepFeed changes at once.
            step = self.feed.set_weights(weights, self.producer.first_open, wait=False)
            self._sample(force=True)
            return step

    def pause(self) -> str:
        with self._controlled():
            self.producer.set_paused(True)
        with self._cond:
            self._observe()
        return "paused"

    def resume(self) -> str:
        with self._controlled():
            self.producer.set_paused(False)
        with self._cond:
            self._observe()
        return "running"

    def heartbeat(self, owner: dict | None = None) -> None:
        """The `serve` process says it is alive (a service whose owner stopped beating is stale)."""
        self._owner = dict(owner or self._owner, beat=time.time())

    def request_stop(self, now: bool = False) -> str:
        """`tokenmill stop`: no step is made any more; each rank gets every step made before
        (none with `now`), then a clean end (`stopped`), and the owning `serve` exits once
        every rank has had its end (the drain; status `drained`)."""
        with self._cond:
            self._stop_requested = True
            self._stop_now = self._stop_now or now
            self.producer.set_paused(True)  # what is made is what the ranks get
            self._wake_all()
            self._observe()
        return STOPPING

    def drain_rejects(self) -> list[dict]:
        with self._cond:
            return self.telemetry.drain_rejects()

    def close(self) -> None:
        if self._scaler is not None:  # it withdraws its request as it ends
            self._scaler.close()
        self.producer.stop()
        for _, feed in self._retired:
            feed.close()
