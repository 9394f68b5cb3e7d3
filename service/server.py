"""The batch server: a named, detached Ray actor that owns the feed and hands out batches.

A producer thread runs the deterministic Feed and keeps the global steps it made in a
window. Rank r of W asks for step s and gets an ObjectRef to its Arrow slice (rows
[r*G/W, (r+1)*G/W) of step s), put into the object store on first request and shared
by zero-copy reads. Per-step resumable states are kept for `GET /v1/state?step=N`.

Flow control: the producer stays at most `prefetch` steps ahead of the slowest active rank.
A slow rank therefore holds the others back by at most `prefetch` steps, never more, and a
rank that disappears is dropped after `rank_timeout_s` so it stops holding anyone back (the
failure of Ray Data's `streaming_split` that ray-project/ray#41973 describes). A rank that
asks for a step older than the window gets a clear error, not a hang.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

from pipeline.config import Config
from pipeline.feed import Feed, rank_slice

SERVER_NAME = "tokenmill"


class StepGone(LookupError):
    """The requested step fell out of the server's window."""


class BatchServer:
    def __init__(
        self,
        cfg_json: dict,
        state: dict | None = None,
        prefetch: int = 8,
        keep_states: int = 10_000,
        rank_timeout_s: float = 120.0,
        allow_config_change: bool = False,
    ):
        self.cfg = Config.model_validate(cfg_json)
        self.prefetch = max(1, prefetch)
        self.keep_states = keep_states
        self.rank_timeout_s = rank_timeout_s
        self._lock = threading.Condition()
        self._steps: OrderedDict[int, object] = OrderedDict()  # step -> RecordBatch
        self._slices: dict[tuple[int, int, int], object] = {}  # (step, rank, world) -> ref
        self._states: OrderedDict[int, dict] = OrderedDict()
        self._ranks: dict[tuple[int, int], dict] = {}  # (rank, world) -> {"next": s, "seen": t}
        self._waits: deque = deque(maxlen=10_000)  # (time, rank, seconds)
        self._paused = False
        self._producing = False
        self._status = "starting"
        self._error: str | None = None
        self._started = time.time()
        self._history: deque = deque(maxlen=3600)  # (time, tokens, rows, shares) per second
        self._start_feed(state, allow_config_change)

    # -- production -------------------------------------------------------------------------

    def _start_feed(self, state: dict | None, allow_config_change: bool = False) -> None:
        self.feed = Feed(self.cfg, state=state, allow_config_change=allow_config_change)
        self.base_step = self.feed.step  # the first step this server produces
        self._states[self.feed.step] = self.feed.state()
        self._generation = getattr(self, "_generation", 0) + 1
        gen = self._generation
        self._thread = threading.Thread(target=self._produce, args=(gen,), daemon=True)
        self._thread.start()

    def _active_min_next(self) -> int | None:
        now = time.time()
        alive = [r["next"] for r in self._ranks.values() if now - r["seen"] < self.rank_timeout_s]
        return min(alive) if alive else None

    def _produce(self, gen: int) -> None:
        try:
            self._status = "running"
            while True:
                with self._lock:
                    while gen == self._generation and (
                        self._paused or self._ahead() >= self.prefetch
                    ):
                        self._status = "paused" if self._paused else "running"
                        self._lock.wait(timeout=1.0)
                    if gen != self._generation:
                        return
                    self._status = "running"
                    self._producing = True
                batch = self.feed.next_step()
                with self._lock:
                    self._producing = False
                    if gen != self._generation:
                        return
                    if batch is None:
                        self._status = "finished"
                        self._lock.notify_all()
                        return
                    step = int(batch.schema.metadata[b"global_step"])
                    self._steps[step] = batch
                    self._states[self.feed.step] = self.feed.state()
                    while len(self._states) > self.keep_states:
                        self._states.popitem(last=False)
                    self._evict()
                    self._record_history()
                    self._lock.notify_all()
        except Exception as e:  # carried to every consumer by `get`, never swallowed
            with self._lock:
                self._status = "failed"
                self._error = f"{type(e).__name__}: {e}"
                self._lock.notify_all()

    def _ahead(self) -> int:
        """How many produced steps the slowest active rank has not taken yet."""
        produced = self.feed.step
        slowest = self._active_min_next()
        if slowest is None:  # nobody connected yet: fill the prefetch window
            slowest = self.base_step
        return produced - slowest

    def _evict(self) -> None:
        slowest = self._active_min_next()
        floor = (
            self.feed.step - self.prefetch - 1
            if slowest is None
            else min(slowest, self.feed.step) - 1
        )
        for s in [s for s in self._steps if s < floor]:
            del self._steps[s]
            for key in [k for k in self._slices if k[0] == s]:
                del self._slices[key]

    def _record_history(self) -> None:
        now = time.time()
        if self._history and now - self._history[-1][0] < 1.0:
            return
        self._history.append(
            (now, self.feed.real_tokens, self.feed.rows, self.feed.mixer.realized())
        )

    # -- consumers ---------------------------------------------------------------------------

    def get(self, rank: int, world_size: int, step: int, timeout_s: float = 60.0):
        """Rank `rank`'s slice of global `step`: [ObjectRef], or None when the data has ended."""
        import ray

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if self.cfg.global_batch_size % world_size:
            raise ValueError(
                f"world size {world_size} does not divide global_batch_size {self.cfg.global_batch_size}"
            )
        deadline = time.time() + timeout_s
        with self._lock:
            self._ranks[(rank, world_size)] = {"next": step, "seen": time.time()}
            self._lock.notify_all()
            while step not in self._steps:
                if self._error:
                    raise RuntimeError(f"the feed failed: {self._error}")
                if step < self.base_step or (self._steps and step < next(iter(self._steps))):
                    raise StepGone(
                        f"step {step} is no longer held (the server holds steps "
                        f"{next(iter(self._steps), self.base_step)}..{self.feed.step - 1}); resume "
                        "from a saved state instead"
                    )
                if self._status == "finished" and step >= self.feed.step:
                    return None
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError(f"step {step} was not produced within {timeout_s}s")
                self._lock.wait(timeout=min(left, 1.0))
            key = (step, rank, world_size)
            ref = self._slices.get(key)
            if ref is None:
                part = rank_slice(self._steps[step], rank, world_size, self.cfg.global_batch_size)
                ref = self._slices[key] = ray.put(part)
            self._ranks[(rank, world_size)] = {"next": step + 1, "seen": time.time()}
            self._lock.notify_all()
            return [ref]  # wrapped, so that Ray hands the caller the ref, not the value

    def first_step(self) -> int:
        return self.base_step

    def report_wait(self, rank: int, seconds: float) -> None:
        self._waits.append((time.time(), rank, float(seconds)))

    def state(self, step: int | None = None) -> dict:
        with self._lock:
            if step is None:
                step = max(self._states)
            if step not in self._states:
                held = (
                    f"{next(iter(self._states))}..{max(self._states)}" if self._states else "none"
                )
                raise StepGone(f"no state for step {step} (states held: {held})")
            return self._states[step]

    def seek(self, state: dict) -> int:
        """Continue from `state` (a trainer resuming). A no-op when the step is still held."""
        step = int(state["step"])
        with self._lock:
            if (
                step in self._states
                and self._states[step] == state
                and (step in self._steps or step == self.feed.step)
            ):
                return step
            self._generation += 1  # stops the old producer
            self._lock.notify_all()
        self._thread.join(timeout=30)
        with self._lock:
            self._steps.clear()
            self._slices.clear()
            self._ranks.clear()
            self._error = None
        self.feed.close()  # stop the old feed's reads before starting the new one's
        self._start_feed(state)
        return step

    # -- control -----------------------------------------------------------------------------

    def set_weights(self, weights: dict[str, float]) -> int:
        """New weights, effective at the first step whose production has not begun."""
        with self._lock:
            return self.feed.set_weights(weights, self.feed.step + int(self._producing))

    def pause(self) -> str:
        with self._lock:
            self._paused = True
            self._lock.notify_all()
        return "paused"

    def resume(self) -> str:
        with self._lock:
            self._paused = False
            self._lock.notify_all()
        return "running"

    def mixture(self) -> dict:
        with self._lock:
            m = self.feed.mixer
            return {
                "weights": dict(
                    zip(m.names, m.scheduled_weights(self.feed.step).tolist(), strict=True)
                ),
                "realized": m.realized(),
                "history": [c.as_dict() for c in m.history],
                "step": self.feed.step,
            }

    def status(self) -> dict:
        with self._lock:
            worlds = sorted({w for _, w in self._ranks})
            return {
                "state": self._status,
                "error": self._error,
                "streams": list(self.cfg.streams),
                "world_size": worlds[-1] if worlds else None,
                "global_step": self.feed.step,
                "uptime_s": time.time() - self._started,
                "config_hash": self.feed.config_hash,
            }

    def metrics(self) -> dict:
        with self._lock:
            s = self.feed.summary()
            now = time.time()
            hist = list(self._history)
            rate_tok = rate_rows = 0.0
            recent = [h for h in hist if now - h[0] <= 30]
            if len(recent) >= 2:
                dt = recent[-1][0] - recent[0][0]
                rate_tok = (recent[-1][1] - recent[0][1]) / dt if dt else 0.0
                rate_rows = (recent[-1][2] - recent[0][2]) / dt if dt else 0.0
            G = self.cfg.global_batch_size
            queue = {
                f"{r}/{w}": max(0, self.feed.step - v["next"]) for (r, w), v in self._ranks.items()
            }
            waits = [w for w in self._waits if now - w[0] <= 60]
            return {
                "tokens_per_s": rate_tok,
                "batches_per_s": rate_rows / G,
                "global_step": self.feed.step,
                "real_tokens": s["real_tokens"],
                "rows": s["rows"],
                "packing_efficiency": s["packing_efficiency"],
                "streams": s["streams"],
                "tokenizer_backend": s["tokenizer_backend"],
                "queue_depth": queue,
                "data_wait_s_last_60s": sum(w[2] for w in waits),
                "data_wait_reports": len(waits),
                "history": [
                    {"t": h[0], "tokens": h[1], "rows": h[2], "shares": h[3]} for h in hist[-600:]
                ],
            }
