"""What the benches read of a process's CPU and the machine's, from /proc: a process's CPU
seconds (`cpu_s`), the machine's busy jiffies, a sampler of both over a run (`Sampler`), and
the lanes' processes of a service (`lane_pids`)."""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from pathlib import Path


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all its threads), or of `pid` (/proc)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (other users included)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return sum(v) - v[3] - v[4], sum(v)  # idle and iowait are not busy


class Sampler:
    """Every 50 ms: (time, machine busy/total jiffies, this process's CPU, the actor's CPU,
    each lane process's CPU)."""

    def __init__(self):
        self.samples: list[tuple] = []
        self.actor_pid: int | None = None
        self.lane_pids: list[int] = []  # the lanes' processes on this machine (`lanes` > 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            actor = None
            if self.actor_pid is not None:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    actor = cpu_s(self.actor_pid)
            lanes = None
            if self.lane_pids:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    lanes = [cpu_s(pid) for pid in self.lane_pids]
            self.samples.append((time.monotonic(), *machine_jiffies(), cpu_s(), actor, lanes))
            self._stop.wait(0.05)

    def window(self, a: float, b: float) -> dict:
        """Figures between the samples nearest to times a and b."""
        times = [s[0] for s in self.samples]

        def at(t):
            i = min(bisect.bisect_left(times, t), len(times) - 1)
            return self.samples[i]

        s0, s1 = at(a), at(b)
        actor = s1[4] - s0[4] if s0[4] is not None and s1[4] is not None else None
        lanes = None
        if s0[5] is not None and s1[5] is not None and len(s0[5]) == len(s1[5]):
            lanes = [y - x for x, y in zip(s0[5], s1[5], strict=True)]
        return {
            "machine_busy": (s1[1] - s0[1]) / max(1, s1[2] - s0[2]),
            "this_process_cpu_s": s1[3] - s0[3],
            "actor_cpu_s": actor,
            "lanes_cpu_s": lanes,  # per lane process
            "seconds": s1[0] - s0[0],
        }


def lane_pids(actor, timeout_s: float = 120.0) -> list[int]:
    """The lanes' processes, once every lane has said where it runs; only if all run on this
    machine (their CPU is read from /proc). Empty with one lane."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lanes = ray.get(actor.metrics.remote(), timeout=30).get("lanes") or []
        if not lanes:
            return []
        if all(d.get("pid") for d in lanes):
            if all(Path(f"/proc/{d['pid']}/stat").exists() for d in lanes):
                return [int(d["pid"]) for d in lanes]
            return []
        time.sleep(0.2)
    return []
