"""`tokenmill serve`: the batch server actor plus the control API, until the data ends."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from pipeline.config import Config
from service.server import SERVER_NAME, BatchServer


def start_server(cfg: Config, name: str = SERVER_NAME, resume: dict | None = None, prefetch: int = 8,
                 allow_config_change: bool = False):  # fmt: skip
    """Launch the named, detached batch-server actor and wait until it answers."""
    import ray

    from service.cluster import NAMESPACE

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise RuntimeError(
            f"a tokenmill service named {name!r} is already running in namespace {NAMESPACE!r}; "
            "stop it first or pass --name"
        )
    actor = (
        ray.remote(BatchServer)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=32,
            max_restarts=0,
        )  # fmt: skip
        .remote(cfg.model_dump(mode="json"), resume, prefetch, 10_000, 120.0, allow_config_change)
    )
    ray.get(actor.status.remote(), timeout=120)
    return actor


def run_serve(cfg: Config, resume: dict | None = None, address: str | None = None,
              host: str | None = None, port: int | None = None, name: str = SERVER_NAME,
              linger_s: float = 30.0, allow_config_change: bool = False) -> int:  # fmt: skip
    import ray
    import uvicorn

    from service.api import Backend, api_token, create_app
    from service.cluster import connect

    started = connect(address)
    actor = start_server(cfg, name, resume, allow_config_change=allow_config_change)
    host = host or os.environ.get("TOKENMILL_HOST") or cfg.service.host
    port = port or int(os.environ.get("TOKENMILL_PORT", cfg.service.port))
    backend = Backend(actor)
    server = uvicorn.Server(
        uvicorn.Config(create_app(backend), host=host, port=port, log_level="warning")
    )
    api = threading.Thread(target=server.run, daemon=True)
    api.start()
    print(f"tokenmill: serving {name!r} (namespace tokenmill), API on http://{host}:{port}"
          + ("" if api_token() else " (mutations disabled: no TOKENMILL_API_TOKEN)"), flush=True)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    code, finished_at, last_print = 0, None, 0.0
    try:
        while not stop.is_set():
            st = backend.call("status")
            m = backend.call("metrics")
            now = time.time()
            if now - last_print >= 10:
                last_print = now
                print(f"  step {st['global_step']:>7}  {m['tokens_per_s']:>10,.0f} tok/s  "
                      f"packing {100 * m['packing_efficiency']:.2f}%  queues {m['queue_depth']}", flush=True)  # fmt: skip
            if st["state"] == "failed":
                print(f"tokenmill: the feed failed: {st['error']}", file=sys.stderr)
                code = 1
                break
            if st["state"] == "finished":
                drained = all(d == 0 for d in m["queue_depth"].values())
                finished_at = finished_at or now
                if drained or now - finished_at > linger_s:
                    print("tokenmill: data ended and ranks drained", flush=True)
                    break
            stop.wait(1.0)
    finally:
        server.should_exit = True
        ray.kill(actor)
        if started:
            ray.shutdown()
    return code
