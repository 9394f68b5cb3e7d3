"""The sequence of steps a batch server makes: its step source built from a state (the
first, a resume's seek, a skip's), installed with a new window and producer, sought,
changed mid-run, and steps already made recomputed (provenance, skips).

`Sequencing` is that part of the batch server (service/batch_server.py): it holds the
running step source (`feed`), its `producer` and the `window`, and changes them under the
server's lock; the rank protocol reads them. The rules of what a seek and a skip make are
pipeline/state/resume.py's and pipeline/feed.py's `LeaveOut`; tests/test_skips.py and
tests/test_provenance.py check them against exports.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from service.server_view import ServerView
from service.window import StepWindow
from wire.protocol import ServiceBusy, StepGone

if TYPE_CHECKING:
    from pipeline.feed import LeaveOut, StepSource


def _unpack(kept) -> dict | None:
    """A state the producer keeps (pipeline/state/resume.py `Kept`) as a dict; None stays."""
    return None if kept is None else kept.unpack()


def _without_losses(state: dict) -> dict:
    """A state without the loss the mixing policy carries in it (`state`), as the producer
    keeps it: what tells whether a resuming rank's state is a step still held."""
    from pipeline.stages.policy import LOSSES
    from pipeline.state.resume import seal

    if LOSSES not in state:
        return state
    return seal({k: v for k, v in state.items() if k != LOSSES})


class Sequencing(ServerView):
    """The batch server's step source and its changes of course. The attributes are the
    server's (`BatchServer.__init__`)."""

    pool: bool
    keep_states: int
    rank_timeout_s: float | None
    generation: int
    _lingering: threading.Condition
    _linger_for: dict[int, int]
    _seek_lock: threading.Lock
    _control: threading.Lock
    _replaying: threading.Lock
    _seeked: dict | None
    _retired: list[tuple[int, StepSource]]

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
                if held and _without_losses(state) in (*kept, self._seeked):
                    return step
            carried = self._carried(state)
            feed = self._make_feed(state)  # raises on a bad state; nothing changed yet
            self.producer.stop()  # also stops the old feed's reads
            with self._cond:
                self.losses.carry(carried, feed.step)
                if self.steering is not None:
                    self.steering.forget_after(feed.step)
                self._install(feed)
                self._seeked = _without_losses(state)
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
        for s, laned in batches.items() if self.feed.hold else ():  # joined here (a rare call)
            try:
                batches[s] = laned.joined()
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
