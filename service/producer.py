"""The producer: runs the deterministic StepFeed on a thread, one global step at a time, into the
step window, whenever the window has room and nobody paused it. Ray-free.

It shares one condition variable with the server, so a rank waiting for a step wakes the
moment that step lands, and the producer wakes the moment a rank frees room. The expensive
`feed.next_step()` runs outside the lock: the API and the ranks are never blocked behind
packing. An exception is never swallowed: it is kept and raised to every consumer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from pipeline.feed import StepSource
from pipeline.state.resume import Kept, Nested
from service.window import StepWindow
from wire.protocol import FAILED, FINISHED, PAUSED, RUNNING, STARTING


class Producer:
    def __init__(
        self,
        feed: StepSource,
        window: StepWindow,
        cond: threading.Condition,
        keep_states: int = 10_000,
        on_step: Callable[[], None] | None = None,
        on_change: Callable[[], None] | None = None,
        gate: Callable[[StepSource, int, Callable[[], bool]], bool] | None = None,
    ):
        self.feed = feed
        self.window = window
        self.cond = cond
        self.keep_states = keep_states
        self.on_step = on_step or (lambda: None)  # under the lock, after each step made
        self.on_change = on_change or (lambda: None)  # under the lock: stop, pause, end, error
        # Called before each step is made, outside the lock, with (feed, step, stopped); may
        # wait (the mixing policy waits for a window's loss). True: it changed the weights of
        # that step, so the step's kept state is taken again (a replay from it decides alike).
        self.gate = gate
        # step -> the state at it, kept (a dict again with `unpack`, when asked for)
        self.states: OrderedDict[int, Kept | Nested] = OrderedDict({feed.step: feed.kept_state()})
        self.state = STARTING
        self.error: str | None = None
        self.paused = False
        self.busy = False  # inside feed.next_step(): that step's weights are fixed
        self.gating = False  # inside `gate`
        # step -> its state before `gate` changed its weights (a rank may hold that one)
        self.decided_from: dict[int, Kept | Nested] = {}
        # The first step whose production has not begun: where a weight change takes effect.
        # Changed only under the lock and never backwards, even when the step being made
        # turns out to be past the end of the data.
        self.first_open = feed.step
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-producer", daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0, close: bool = True) -> None:
        """Stop producing and stop the feed's reads; safe to call more than once. `close`
        False: the caller closes the feed (lanes that still hold rows ranks will fetch)."""
        with self.cond:
            self._stop = True
            self._changed()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)
        if close:
            self.feed.close()

    def set_paused(self, paused: bool) -> None:
        with self.cond:
            self.paused = paused
            self._changed()

    def _changed(self) -> None:
        """A stop, pause, end or error (under the lock): wake every waiter."""
        self.cond.notify_all()
        self.on_change()

    @property
    def idle(self) -> bool:
        """Neither making a step nor deciding one (under the lock): paused, it stays so."""
        return not self.busy and not self.gating

    @property
    def stopping(self) -> bool:
        """`stop` was called."""
        return self._stop

    @property
    def ended(self) -> bool:
        return self.state in (FINISHED, FAILED)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.state = PAUSED if self.paused else RUNNING
                    while not self._stop and (self.paused or not self.window.room()):
                        self.state = PAUSED if self.paused else RUNNING
                        # The ranks set the pace now, until one waits (server.get); a lane
                        # a rank started again is placed, or fails naming it.
                        self.feed.ranks_behind = True
                        self.feed.check_placed()
                        self.cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    step = self.feed.step
                    self.gating = self.gate is not None
                    if self.gating:  # a weight change from now on is for the step after it
                        self.first_open = step + 1
                changed = False
                try:
                    if self.gate is not None:  # a pause interrupts it too (then asked again)
                        changed = self.gate(self.feed, step, lambda: self._stop or self.paused)
                finally:
                    with self.cond:
                        self.gating = False
                with self.cond:
                    if changed:  # the state a rank may have taken before stays acceptable
                        if step in self.states:
                            self.decided_from[step] = self.states[step]
                        self.states[step] = self.feed.kept_state()
                    if self._stop:
                        return
                    if self.paused or not self.window.room():
                        self.first_open = step  # not begun: a change may still land on it
                        continue
                    self.state = RUNNING
                    self.busy = True
                    self.first_open = self.window.produced + 1
                batch = self.feed.next_step()
                with self.cond:
                    self.busy = False
                    if self._stop:
                        return
                    if batch is None:
                        self.state = FINISHED
                        self._changed()
                        return
                    self.window.add(self.feed.step - 1, batch)
                    self.states[self.feed.step] = self.feed.kept_state()
                    while len(self.states) > self.keep_states:
                        old, _ = self.states.popitem(last=False)
                        self.decided_from.pop(old, None)
                    self.on_step()
                    self.cond.notify_all()
        except Exception as e:  # carried to every consumer, never swallowed
            with self.cond:
                self.busy = False
                self.state = FAILED
                self.error = f"{type(e).__name__}: {e}"
                self._changed()
