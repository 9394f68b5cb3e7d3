"""The batch server: the Ray actor that owns the feed and hands out batches.

Ray-free parts do the work, each unit-tested on its own:
- `window.StepWindow`: the world, retention (a step is held until every rank of the world has
  taken it) and flow control (at most `prefetch` steps ahead of the slowest live rank);
- `producer.Producer`: the deterministic StepFeed on a thread, one step at a time, into the window;
- `telemetry.Telemetry`: throughput history, data wait per rank, the rejects buffer;
- `autoscale.Autoscaler` (with `service.autoscale`): a thread that asks the cluster for CPUs
  while the ranks wait (the rule: `demand.Demand`).

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
import socket
import threading
import time
from typing import TYPE_CHECKING

from service.losses import StreamLosses
from service.window import StepWindow
from wire.arrays import to_ipc
from wire.protocol import (
    BEAT_S,
    FAILED,
    FINISHED,
    LINGER_S,
    LOOKAHEAD,
    POLL_S,
    PRODUCER_ENDED,
    PRODUCER_FAILED,
    PRODUCER_MAKING,
    PRODUCER_PAUSED,
    PRODUCER_STARTING,
    PRODUCER_STOPPING,
    PRODUCER_WAITING_LOSS,
    PRODUCER_WINDOW_FULL,
    REPLY_BYTES,
    STARTING,
    STOPPING,
    WINDOW_BYTES,
    WINDOW_STEPS,
    ServiceBusy,
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


def _unpack(kept) -> dict | None:
    """A state the producer keeps (pipeline/state/resume.py `Kept`) as a dict; None stays."""
    return None if kept is None else kept.unpack()


def _bare(state: dict) -> dict:
    """A state without the loss the mixing policy carries in it (`state`), as the producer
    keeps it: what tells whether a resuming rank's state is a step still held."""
    from pipeline.stages.policy import LOSSES
    from pipeline.state.resume import seal

    if LOSSES not in state:
        return state
    return seal({k: v for k, v in state.items() if k != LOSSES})


# A rank's current wait for data is named a stall (status and metrics `stall`) from this long.
STALL_S = 5.0


class _Default(enum.Enum):
    """A sentinel type: `rank_timeout_s` None means no timeout, so "not given" needs its own."""

    TOKEN = 0


_DEFAULT = _Default.TOKEN
# Past this many ranks, the lag history keeps min / median / max, not every rank's lag (an hour
# of one-second samples of 1,024 ranks held ~220 MB and took 0.4 s to serve under the lock).
OBSERVED_RANKS = 64


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


class BatchServer:
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

    def _carried(self, state: dict | None) -> dict[int, dict[str, list[float]]]:
        """The loss a resume's state carries for the mixing policy's next decisions
        (pipeline/stages/policy.py `LOSSES`), checked; StateError if malformed."""
        from pipeline.stages.policy import LOSSES, check_losses, needed_steps
        from pipeline.state.resume import StateError

        policy = self.cfg.mixing.policy
        if policy is None or state is None:
            return {}
        try:
            step = int(state["step"])
            needed = needed_steps(step, policy.every, policy.delay)
        except (KeyError, TypeError, ValueError):
            return {}  # the feed refuses the state, with its own error
        if LOSSES not in state:
            # A state of a run without the policy (it is turned on at this resume): the steps
            # before it count as reported with no signal, so the first decisions keep the
            # weights in effect. Deterministic, as the state is.
            return {s: {} for s in needed}
        try:
            carried = check_losses(state[LOSSES], list(self.cfg.streams))
        except ValueError as e:
            raise StateError(f"resume state: {e}") from None
        if state.get("config_hash") != self.cfg.config_hash():  # every, delay may differ
            return {s: carried.get(s, {}) for s in needed}
        if set(carried) != needed:
            odd = sorted(set(carried) ^ needed)
            raise StateError(
                f"resume state: {LOSSES} holds the loss of steps {sorted(carried)[:3]}..., "
                f"the mixing policy's next decisions read steps {min(needed)}-{max(needed)} "
                f"(differing at step {odd[0]}): use the state as the service handed it out"
            )
        return carried

    def _make_feed(self, state: dict | None, allow_config_change: bool = False,
                   leave_out: LeaveOut | None = None) -> StepSource:  # fmt: skip
        """A StepFeed at `state`; a state that does not fit raises here, before anything changes.

        Reads as an export does: this process tokenizes the first units itself (the head
        start) until the workers deliver: the warm pool on a running cluster (`pool`: its
        actors outlive a service, so the next one finds them warm), else Ray Data tasks.
        Where the pool's actors are already up, they make the first units too. The blocks
        are the same whoever tokenizes them, so the sequence is too."""
        from pipeline.feed import StepFeed
        from pipeline.lanes import LanedFeed
        from pipeline.read.pool import pool_executor, pool_is_warm
        from pipeline.read.reading import iter_blocks_ray, with_head_start
        from pipeline.state.resume import StateError

        executor = pool_executor(None) if self.pool else iter_blocks_ray
        # A warm pool (an earlier export's or service's actors) makes the first units from
        # the start: no head start here, and the tokenizer loads on a thread meanwhile (this
        # process needs only its pad id). Measured by bench/first_batch.py.
        warm = self.pool and self.cfg.lanes == 1 and pool_is_warm(None)
        # Paced: the executor starts only once this process's tokenizing falls behind what
        # the ranks take (headstart.py): its start took the cores from the first steps.
        first = executor if warm else with_head_start(executor, paced=True)
        try:
            if self.cfg.lanes > 1:
                # K lane actors read (Ray Data), mix, pack and keep their rows; this actor
                # keeps the window of where they are, and ranks take them from the lanes
                # (`hold`: no token passes through here). Every step's state is kept, as a
                # StepFeed's (the window).
                return LanedFeed(self.cfg, state=state, allow_config_change=allow_config_change,
                                 full_batches=False, state_every=1,
                                 on_reject=self.telemetry.add_reject,
                                 wait_for_figures=False, leave_out=leave_out,
                                 hold=True, restarts=self.cfg.service.lane_restarts)  # fmt: skip
            feed = StepFeed(
                self.cfg,
                executor,
                first,
                state=state,
                allow_config_change=allow_config_change,
                on_reject=self.telemetry.add_reject,
                leave_out=leave_out,
            )
            # Steps in the compact layout (wire/layout.py): no derivable column is built
            # here, and a rank's slice of 4 x 2048 tokens is ~35 KB instead of ~170 KB, under
            # Ray's inline-reply limit. The rank's Feed expands it (trainer/feed.py).
            feed.full_batches = False
            return feed
        except StateError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            if state is None:
                raise
            raise StateError(f"resume state refused: {type(e).__name__}: {e}") from None

    def _install(self, feed: StepSource) -> None:
        # A new sequence (the first, or a resume's seek): ranks that connected to an earlier
        # one are told so when they ask (`get`), instead of waiting for steps that never come.
        self.generation = getattr(self, "generation", -1) + 1
        self.feed = feed
        self.window = StepWindow(feed.step, self.prefetch, self.rank_timeout_s)
        self.producer = self._producer(feed)
        self.producer.start()  # after the assignment: its first step's callbacks read it

    def _producer(self, feed: StepSource):
        from service.producer import Producer

        return Producer(
            feed, self.window, self._cond, self.keep_states, on_step=self._on_step,
            on_change=self._lingering.notify_all,
            gate=None if self.steering is None else self.steering.gate,
        )  # fmt: skip

    def _on_step(self) -> None:  # under the lock, after each produced step
        self._sample(force=False)
        self._observe()
        if self._linger_for and self.window.produced >= min(self._linger_for.values()):
            self._lingering.notify_all()

    def _wake_all(self) -> None:  # under the lock: every waiting rank, lingering or not
        self._cond.notify_all()
        self._lingering.notify_all()

    def _observe(self) -> None:
        """Under the lock: the producer's state and each rank's lag into telemetry, once a
        second or at once when the state changes (`rank_view` is O(world): not every step)."""
        state, now = self.producer_state(), time.monotonic()
        if state == self._observed[1] and now - self._observed[0] < 1.0:
            return
        self._observed = (now, state)
        lags: dict = {r: v["lag"] for r, v in self.window.rank_view().items()}
        if len(lags) > OBSERVED_RANKS:  # an hour of a large world's lags: kept as a summary
            ordered = sorted(lags.values())
            lags = {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}
        self.telemetry.observe(state, lags)

    def _sample(self, force: bool) -> None:
        if not self.telemetry.due(force):  # every step calls; one a second is kept
            return
        m = self.feed.mixer
        targets = dict(zip(m.names, m.scheduled_weights(max(self.feed.step - 1, 0)).tolist(), strict=True))  # fmt: skip
        self.telemetry.sample(self.feed.real_tokens, self.feed.rows, m.realized(), targets, force)

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
                    self.losses.excuse(rank, world_size, first, policy.every + policy.delay)
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

        Why: a rank's cost, and the actor's, is mostly per call (Ray's RPC on both sides). On
        2 cores, 8 ranks that consume as fast as they can took 1 to 3 steps per call and spent,
        with the actor, ~26 ms of CPU per global step, on the cores that tokenize; lingering,
        ~7 steps per call and ~14 ms; with LOOKAHEAD 32 and one decode per run, ~26 steps per
        call and ~10 ms (bench/serve_ranks.py)."""
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
                    break
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
        from pipeline.feed import rank_runs
        from pipeline.lanes import LanedStep, where

        if isinstance(batches[0], LanedStep):  # the lanes hold the rows: where to take them
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

    def _why_waiting(self) -> str:
        if self.producer.paused:
            return "paused"
        if self.steering is not None and self.steering.waiting is not None:
            lo, hi = self.steering.waiting
            return f"the mixing policy waits for every rank's loss of steps {lo}-{hi - 1}"
        if self.window.room() or self.producer.busy:
            return "producing"
        slow = [
            r
            for r, v in self.window.rank_view().items()
            if not v["lost"] and v["next_step"] == self.window.floor()
        ]
        return f"waiting for rank(s) {slow} (prefetch window of {self.prefetch} steps is full)"

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

    def provenance(self, step: int, world_size: int | None = None, text: bool = False) -> list:
        """Which documents fed global step `step` (pipeline/inspect/provenance.py): from the step if
        the window still holds it, else recomputed in this process from the newest state kept
        at or before it (the feed rebuilt there, run forward: at most the steps between)."""
        from pipeline.inspect.provenance import decoder, segments, stream_files

        with self._cond:
            world = world_size or self.window.world or 1
        batch = self._step_batches([step])[step]
        if world < 1 or self.cfg.global_batch_size % world:
            raise ValueError(f"world size {world} does not divide {self.cfg.global_batch_size}")
        files = stream_files(self.cfg)
        decode = decoder(self.cfg) if text else None
        return segments(batch, step, files, world, self.cfg.global_batch_size, decode)

    def seek(self, state: dict) -> int:
        """Continue from `state` (ranks resuming). A no-op when that step is still held.

        The new feed is built (and the state validated) first; only then is the running one
        swapped out. A bad state is refused and leaves the running sequence untouched."""
        try:
            step = int(state["step"])
        except (TypeError, KeyError, ValueError):
            from pipeline.state.resume import StateError

            raise StateError("resume state has no integer 'step'") from None
        with self._seek_lock:
            with self._cond:
                held = step in self.window.steps or step == self.window.produced
                kept = (_unpack(self.producer.states.get(step)),
                        _unpack(self.producer.decided_from.get(step)))  # fmt: skip
                if held and _bare(state) in (*kept, self._seeked):
                    return step
            carried = self._carried(state)
            feed = self._make_feed(state)  # raises on a bad state; nothing changed yet
            self.producer.stop()  # also stops the old feed's reads
            with self._cond:
                self.losses.carry(carried, feed.step)
                if self.steering is not None:
                    self.steering.forget_after(feed.step)
                self._install(feed)
                self._seeked = _bare(state)
                retired, self._retired = self._retired, []  # a new sequence: nobody needs them
                self._wake_all()
            for _, old_feed in retired:
                old_feed.close()
            return step

    def skip(self, steps: list[int] | None = None, docs: list | None = None,
             why: str | None = None) -> dict:  # fmt: skip
        """Leave documents out of a running service from the first step not made yet (POST
        /v1/skips): the documents of `steps` (made already: held, or recomputed from a kept
        state) and those `docs` names ({stream, doc_id} or {stream, source, record}).

        The result is by construction what `serve --resume STATE --skip-...` makes from the
        state at that step (pipeline/feed.py `LeaveOut` has the rule): the producer is paused
        once the step it makes is done, a feed is built from that step's state with the
        documents left out, and only then swapped in, on the same window. Steps made before
        stay as they are (ranks may hold them) and connected ranks go on without a restart:
        no new generation. A feed that cannot be built leaves the running one as it was. The
        state carries the list and its log (step, count, `why`), so every later state and
        resume leaves them out too."""
        from pipeline.inspect.provenance import leave_out, named_documents

        with self._seek_lock, self._controlled():
            if self._stop_requested or self.producer.stopping or self.producer.error:
                why_not = self.producer.error or "stopping"
                raise ValueError(f"the service is not making steps ({why_not}): nothing to skip")
            named = self._step_documents(steps) if steps else []
            if docs:
                named += named_documents(self.cfg, list(docs),
                                         [f"docs[{i}]" for i in range(len(docs))])  # fmt: skip
            if not named:
                raise ValueError("name steps already made, or documents, to leave out")
            from pipeline.inspect.provenance import format_steps

            said = [f"steps {format_steps(steps)}"] if steps else []
            said += [f"{len(docs)} named document(s)"] if docs else []
            chosen = leave_out(named, f"POST /v1/skips: {', '.join(said)}"
                                      + (f" ({why})" if why else ""))  # fmt: skip
            paused = self.producer.paused  # the user's pause, kept
            self.producer.set_paused(True)
            with self._cond:
                while not self.producer.idle:
                    self._cond.wait(timeout=1.0)
                if self.producer.ended:
                    self.producer.set_paused(paused)
                    raise ValueError(f"the data ended at step {self.window.produced}: "
                                     "nothing is left to leave out")  # fmt: skip
                step = self.feed.step
                state = self.producer.states[step].unpack()
                assert step == self.window.produced  # paused and idle: nothing is being made
            try:
                feed = self._make_feed(state, leave_out=chosen)
            except BaseException:
                self.producer.set_paused(paused)
                raise
            old = self.producer
            held = old.feed.hold  # its lanes hold rows ranks may fetch
            old.stop(close=not held)  # idle and paused: at once; closes the old feed's reads
            if held:
                old.feed.stop_reading()
            with self._cond:
                if held:  # closed once every rank has what they hold (`_release_lanes`)
                    self._retired.append((feed.step, old.feed))
                self._swap(feed, old, paused)
                self._wake_all()
            count = {k: len(v) for k, v in chosen.docs.items()}
            return {"step": step, "left_out": count, "why": chosen.why}

    @contextlib.contextmanager
    def _controlled(self):
        """One change of the producer's course at a time (a skip, a weight change, a pause
        or resume): a skip pauses the producer and builds a new feed from the state where it
        stopped, and a change in between would be lost or undone. Busy for 5 s: ServiceBusy."""
        if not self._control.acquire(timeout=5.0):
            raise ServiceBusy("a skip is being applied (POST /v1/skips); try again")
        try:
            yield
        finally:
            self._control.release()

    def _step_documents(self, steps: list[int]) -> list[dict]:
        """The distinct documents global `steps` (ascending) drew."""
        from pipeline.inspect.provenance import documents_of, segments, stream_files

        batches = self._step_batches(steps)
        files = stream_files(self.cfg)
        G = self.cfg.global_batch_size
        return documents_of(s for step in steps for s in segments(batches[step], step, files, 1, G))

    def _step_batches(self, steps: list[int]) -> dict:
        """Global `steps` (ascending, made): from the window where it holds them, the others
        recomputed in this process in one pass from the newest state kept at or before the
        first of them (the feed rebuilt there, run forward: at most the steps between)."""
        from pipeline.inspect.provenance import state_steps

        with self._cond:
            produced = self.window.produced
            batches = {s: self.window.steps[s] for s in steps if s in self.window.steps}
            rest = [s for s in steps if s not in batches]
            states = self.producer.states
            base = max((k for k in states if k <= rest[0]), default=None) if rest else None
            kept = None if base is None else states[base]
            held = f"{next(iter(states))}..{max(states)}" if states else "none"
        if steps[-1] >= produced:
            raise StepGone(f"step {steps[-1]} has not been produced yet (produced: {produced})")
        state = _unpack(kept)
        from pipeline.lanes import LanedStep

        for s, held in batches.items():  # rows the lanes hold: joined here (a rare call)
            if isinstance(held, LanedStep):
                try:
                    batches[s] = held.whole()
                except Exception as e:  # let go meanwhile, or its lanes closed
                    raise StepGone(
                        f"step {s}: its lanes no longer hold it ({type(e).__name__}); "
                        "try again: it is recomputed from a kept state"
                    ) from None
        if rest:
            if state is None:
                raise StepGone(f"no state at or before step {rest[0]} is kept (states: {held})")
            # A replay reads and tokenizes in this process, on a thread of `control`: one at
            # a time, so that the API, the `serve` loop and the ranks' states keep theirs.
            if not self._replaying.acquire(blocking=False):
                raise ServiceBusy("another step's provenance is being recomputed; try again")
            try:
                batches.update(state_steps(self.cfg, state, rest))
            finally:
                self._replaying.release()
        return batches

    def _swap(self, feed: StepSource, old, paused: bool) -> None:
        """Under the lock: `feed` (at the step `old` stopped at) makes the steps from here on,
        into the same window; the states kept so far stay."""
        self.feed = feed
        self.producer = self._producer(feed)
        states = old.states
        states[feed.step] = self.producer.states[feed.step]  # with the documents left out
        self.producer.states = states
        self.producer.paused = paused
        self.producer.start()

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

    def _stall(self, ranks: dict[int, dict]) -> dict:
        """Under the lock: the ranks waiting now for steps not made yet, for how long, and a
        stall named once one has waited STALL_S (`ranks [0, 1] waiting 46 s: paused`)."""
        waiting = {r: v["waiting_s"] for r, v in ranks.items()
                   if v["waiting_s"] is not None and not (v["lost"] or v["left"])}  # fmt: skip
        worst = max(waiting.values(), default=0.0)
        stall = None
        if worst >= STALL_S:
            stall = f"ranks {sorted(waiting)} waiting {worst:.0f} s: {self._why_waiting()}"
        return {"ranks_waiting_s": {str(r): w for r, w in waiting.items()}, "stall": stall}

    def _ended(self) -> bool:
        """No step will be made any more: the data ended, or a stop was asked."""
        return self.producer.ended or self._stop_requested

    def drain_rejects(self) -> list[dict]:
        with self._cond:
            return self.telemetry.drain_rejects()

    def close(self) -> None:
        if self._scaler is not None:  # it withdraws its request as it ends
            self._scaler.close()
        self.producer.stop()
        for _, feed in self._retired:
            feed.close()

    def mixture(self) -> dict:
        with self._cond:
            m = self.feed.mixer
            return {
                "weights": dict(
                    zip(m.names, m.scheduled_weights(self.feed.step).tolist(), strict=True)
                ),  # fmt: skip
                "realized": m.realized(),
                "history": [c.as_dict() for c in m.history],
                "step": self.feed.step,
            }

    def producer_state(self) -> str:
        """What the producer does now (under the lock): `making` a step, `window_full` (every
        rank has `prefetch` steps unconsumed ahead of it: the normal state of a data plane
        faster than its trainer), `paused`, `ended`, `failed`, `stopping` or `starting`."""
        if self._stop_requested:
            return PRODUCER_STOPPING
        p = self.producer
        if p.state == FAILED:
            return PRODUCER_FAILED
        if p.state == FINISHED:
            return PRODUCER_ENDED
        if p.paused:
            return PRODUCER_PAUSED
        if self.steering is not None and self.steering.waiting is not None:
            return PRODUCER_WAITING_LOSS
        if p.state == STARTING and not p.busy:
            return PRODUCER_STARTING
        if not p.busy and not self.window.room():
            return PRODUCER_WINDOW_FULL
        return PRODUCER_MAKING

    def status(self) -> dict:
        with self._cond:
            ranks = self.window.rank_view()
            beat = self._owner.get("beat")
            return {
                "state": STOPPING if self._stop_requested else self.producer.state,
                "producer": self.producer_state(),
                "drained": self._ended() and self.window.drained(self._stop_requested),
                "error": self.producer.error,
                "streams": list(self.cfg.streams),
                "world_size": self.window.world,
                "ranks_connected": sum(r["connected"] for r in ranks.values()),
                "lost_ranks": [r for r, v in ranks.items() if v["lost"]],
                "left_ranks": [r for r, v in ranks.items() if v.get("left")],
                # connected ranks not yet told the end (what a drain waits for)
                "ranks_to_end": [
                    r
                    for r, v in ranks.items()
                    if v["connected"] and not (v["ended"] or v["lost"] or v["left"])
                ],
                **self._stall(ranks),
                "global_step": self.window.produced,
                "first_step": self.window.start,
                "uptime_s": time.time() - self._started,
                "config_hash": self.feed.config_hash,
                "owner": {k: v for k, v in self._owner.items() if k != "beat"},
                "owner_beat_s_ago": None if beat is None else time.time() - beat,
                "server": {"pid": os.getpid(), "host": socket.gethostname()},
                "autoscale": None if self.demand is None else self.demand.view(),
            }

    def metrics(self) -> dict:
        with self._cond:
            self._observe()
            s = self.feed.summary()
            tel = self.telemetry
            tok_rate, row_rate = tel.rates()
            ranks = self.window.rank_view()
            waits = tel.wait_by_rank()
            # What the trainers consume (their beats' steps a second, each rank's G/W rows of
            # seq_len at the run's packing efficiency): real tokens, beside what is made.
            W = self.window.world or 1
            per_step = self.cfg.global_batch_size / W * self.cfg.seq_len * s.packing_efficiency
            consumed = 0.0
            for r, v in ranks.items():
                v["wait_s_last_60s"], v["waits"] = waits.get(r, (0.0, 0))
                rate = v["consumed_steps_per_s"]
                v["consumed_tokens_per_s"] = None if rate is None else rate * per_step
                consumed += v["consumed_tokens_per_s"] or 0.0
            all_waits = list(waits.values())
            return {
                "tokens_per_s": tok_rate,
                "consumed_tokens_per_s": consumed,
                **self._stall(ranks),
                "batches_per_s": row_rate / self.cfg.global_batch_size,
                "producer": self.producer_state(),
                "lag_normal_max": self.prefetch + min(LOOKAHEAD, self.prefetch),
                "global_step": self.window.produced,
                "held_steps": len(self.window.steps),
                # `lanes` > 1: where each lane runs and the steps it holds (pipeline/lanes/feed.py `lane_view`)
                "lanes": self.feed.lane_view(),
                "lanes_waited_s": self.feed.waited_s,  # producer, on lanes
                "lanes_chunks_ahead": self.feed.depth,  # LanedFeed.depth
                # lanes started again after their process died (LanedFeed.restart)
                "lanes_restarted": list(self.feed.restarted),
                "prefetch": self.prefetch,
                # Row bytes that passed through this (the control) process to ranks, and the
                # rank-steps they held: 0 with `lanes` > 1, where ranks pull from the lanes.
                "control_row_bytes": self._sent[0],
                "control_rank_steps": self._sent[1],
                "real_tokens": s.real_tokens,
                "rows": s.rows,
                "packing_efficiency": s.packing_efficiency,
                "streams": {name: st.as_dict() for name, st in s.streams.items()},
                "tokenizer_backend": s.tokenizer_backend,
                "world_size": self.window.world,
                "ranks": {str(r): v for r, v in ranks.items()},
                "queue_depth": {str(r): v["lag"] for r, v in ranks.items()},
                "data_wait_s_last_60s": sum(w for w, _ in all_waits),
                "data_wait_reports": sum(n for _, n in all_waits),
                "rejects": tel.rejects_total,
                "rejects_unlisted": tel.rejects_unlisted,
                "mixture_history": s.mixture_history,
                "history": tel.history_view(),
                "observations": tel.observations_view(),
                "stream_loss": self.losses.view(),
                "left_out": s.left_out,  # documents a resume left out (--skip-steps, --skip-docs)
                "policy": None if self.steering is None else self.steering.view(),
            }
