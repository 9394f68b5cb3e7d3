"""Model-less trainer ranks for the serving benches: each connects to a service and takes its
steps as fast as it can (`pull`), as processes of their own, one Ray driver each, as torchrun
starts them (`RankProcesses`; `python -m bench.ranks SERVICE RANK WORLD STEPS OUT` is one), or
as threads of the bench's process (`RankThreads`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.cpu import cpu_s

WORLD = 8  # ranks by default (serving's --world-size)


def pull(service: str, rank: int, world: int, steps: int, address: str | None = None) -> dict:
    """Connect as `rank` of `world` and take `steps` batches as fast as possible.

    Returns {"steps": [[global_step, t_done, latency_s, real_tokens, cpu_s, t_arrived], ...]}:
    times on time.monotonic (one clock for every process of this machine), cpu_s this
    process's; t_arrived when the answer that carried the step arrived (the t_done of the
    first step that answer carried)."""
    from trainer.feed import Feed

    feed = Feed.connect(service=service, rank=rank, world_size=world, address=address,
                        timeout_s=120)  # fmt: skip
    out, arrived = [], 0.0
    for _ in range(steps):
        t, calls = time.monotonic(), feed.calls
        batch = next(feed, None)
        done = time.monotonic()
        if batch is None:
            break
        arrived = done if feed.calls != calls else arrived
        tokens = sum(sum(lens) for lens in batch["seq_lens"])
        out.append([batch["global_step"], done, done - t, tokens, cpu_s(), arrived])
    calls = feed.calls
    feed.close()
    return {"rank": rank, "steps": out, "calls": calls}


def _rank_process(argv: list[str]) -> int:
    """`python -m bench.ranks SERVICE RANK WORLD STEPS OUT`: import Ray, torch
    and the feed; read the cluster's address from stdin, join it, print `ready`; on `go`,
    pull and write OUT (JSON)."""
    service, rank, world, steps, out = argv
    import ray  # noqa: F401
    import torch  # noqa: F401  (the feed's Arrow -> torch copy would import it on step 0)

    import trainer.feed  # noqa: F401
    from client.cluster import client_address, connect

    gcs = sys.stdin.readline().strip()
    if not gcs:  # the run ended before it started Ray: never join another cluster
        return 1
    connect(client_address(gcs))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    result = pull(service, int(rank), int(world), int(steps), address=gcs)
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)  # the run goes on when every file is there
    # Leave at once: a Ray driver's orderly exit costs seconds of CPU per rank, and the
    # cluster, whose GCS notices the closed connection, is shut down right after.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankProcesses:
    """`world` rank processes, idle until `go()`; killed by pid if they outlive the run."""

    def __init__(self, service: str, steps: int, work: Path, world: int = WORLD):
        env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENMILL_RAY_LOGS": "0"}
        self.outs = [work / f"rank-{r}.json" for r in range(world)]
        self.logs = [work / f"rank-{r}.log" for r in range(world)]
        self.procs = []
        for r in range(world):
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.ranks", service, str(r),
                     str(world), str(steps), str(self.outs[r])],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                ))  # fmt: skip

    def join(self, gcs: str) -> None:
        self._say(gcs)

    def wait_ready(self) -> None:
        for r, p in enumerate(self.procs):
            if p.stdout.readline().strip() != "ready":  # a rank that died reads "" (EOF)
                raise RuntimeError(f"rank {r} did not start: {self._tail(r)}")

    def go(self) -> None:
        self._say("go")

    def _say(self, line: str) -> None:
        for p in self.procs:
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def results(self, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        for r, (p, out) in enumerate(zip(self.procs, self.outs, strict=True)):
            while not out.exists():
                if p.poll() is not None:
                    raise RuntimeError(f"rank {r} failed ({p.returncode}): {self._tail(r)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {r} did not finish: {self._tail(r)}")
                time.sleep(0.05)
        return [json.loads(o.read_text()) for o in self.outs]

    def _tail(self, r: int) -> str:
        return self.logs[r].read_text()[-2000:]

    def close(self, timeout_s: float = 30) -> None:
        """Let the ranks leave Ray (they exit after their results), kill any left (by pid)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()  # a rank still waiting for its address or `go` reads EOF
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class RankThreads:
    """`world` ranks as threads of this process (already a Ray driver)."""

    def __init__(self, service: str, steps: int, world: int = WORLD):
        self.service, self.steps, self.world = service, steps, world
        self.got: dict[int, dict] = {}
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(r,), daemon=True)
                        for r in range(world)]  # fmt: skip

    def _run(self, r: int) -> None:
        try:
            self.got[r] = pull(self.service, r, self.world, self.steps)
        except Exception as e:
            self.errors.append(f"rank {r}: {type(e).__name__}: {e}")

    def join(self, gcs: str) -> None:
        pass

    def wait_ready(self) -> None:
        import torch  # noqa: F401

        import trainer.feed  # noqa: F401

    def go(self) -> None:
        for t in self.threads:
            t.start()

    def results(self, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(timeout=max(1.0, deadline - time.monotonic()))
        if self.errors or len(self.got) < self.world:
            raise RuntimeError("; ".join(self.errors) or "ranks did not finish")
        return [self.got[r] for r in range(self.world)]

    def close(self, timeout_s: float = 30) -> None:
        pass


if __name__ == "__main__":
    raise SystemExit(_rank_process(sys.argv[1:]))
