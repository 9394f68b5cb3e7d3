"""`tokenmill serve`, `stop` and `status`: the service's lifecycle.

`serve` starts the batch-server actor (owned by this process: when the process dies, Ray
removes the actor with it), the control API, and a one-second loop that beats the actor's
heartbeat, appends skipped records to the rejects file and watches for the end. It exits on
SIGTERM or Ctrl-C, on `tokenmill stop`, when the feed fails, or when the data has ended and
the ranks have taken every step. Exiting stops production, closes the feed's reads and the
actor, and takes a few seconds.

A service named N also leaves a small file (`$TOKENMILL_CACHE/services/N.json`: the Ray
address, the pid, the API URL) so that `tokenmill stop/status --name N` find a service whose
Ray was embedded, without `--address`. The file is removed on exit; a stale one is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from pipeline.config import REVEAL_SECRETS, Config
from service.protocol import CONCURRENCY_GROUPS, FAILED, FINISHED, NAMESPACE, SERVICE_NAME, STOPPING
from service.server import BatchServer

STALE_BEAT_S = 10.0  # a service whose serve process has not beaten for this long is stale
EXIT_GRACE_S = 2.0


class ServiceExists(RuntimeError):
    pass


def start_server(cfg: Config, name: str = SERVICE_NAME, resume: dict | None = None,
                 prefetch: int | None = None, allow_config_change: bool = False):  # fmt: skip
    """Launch the named batch-server actor, owned by this process, and wait until it answers.

    A service of that name whose `serve` process is gone (no heartbeat for STALE_BEAT_S, or
    an actor that no longer answers) is removed first; a live one is an error."""
    import ray

    _remove_if_stale(name)
    # ray's stubs type only the task options here; the actor options are valid at run time.
    actor_class = ray.remote(  # type: ignore[call-overload]
        num_cpus=0,
        max_concurrency=16,
        concurrency_groups=dict(CONCURRENCY_GROUPS),
        max_restarts=0,
    )(BatchServer)
    placement = {"resources": dict(cfg.service.resources)} if cfg.service.resources else {}
    actor = actor_class.options(name=name, namespace=NAMESPACE, **placement).remote(
        cfg.model_dump(mode="json", context=REVEAL_SECRETS), resume, prefetch, 10_000, cfg.service.rank_timeout_s,
        allow_config_change,
    )  # fmt: skip
    ray.get(actor.status.remote(), timeout=120)
    return actor


def _remove_if_stale(name: str) -> None:
    import ray

    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        st = ray.get(old.status.remote(), timeout=5)
    except Exception:  # dead, dying, or a service of an older version
        st = None
    if st is not None:
        beat = st.get("owner_beat_s_ago")
        if beat is None or beat < STALE_BEAT_S:
            owner = st.get("owner") or {}
            raise ServiceExists(
                f"a tokenmill service named {name!r} is already running (serve pid "
                f"{owner.get('pid', '?')} on {owner.get('host', '?')}); stop it with "
                f"`tokenmill stop --name {name}` or choose another --name"
            )
    print(f"tokenmill: removing the stale service {name!r} (its serve process is gone)",
          file=sys.stderr)  # fmt: skip
    ray.kill(old, no_restart=True)
    deadline = time.time() + 10
    while time.time() < deadline:  # the name is released once the actor is dead
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)


def service_file(name: str) -> Path:
    root = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    return root / "services" / f"{name}.json"


class RejectsFile:
    """Appends drained rejects to the `service.rejects` file (one JSON object a line)."""

    def __init__(self, path: str | None):
        self.path = Path(path).resolve() if path else None
        self.written = 0

    def append(self, rejects: list[dict]) -> None:
        if not rejects or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rejects)
        self.written += len(rejects)


def run_serve(cfg: Config, resume: dict | None = None, address: str | None = None,
              host: str | None = None, port: int | None = None, name: str = SERVICE_NAME,
              linger_s: float = 30.0, allow_config_change: bool = False) -> int:  # fmt: skip
    import ray
    import uvicorn

    from service.api import Backend, api_token, create_app
    from service.cluster import connect, shutdown

    started = connect(address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    actor = None
    record = service_file(name)
    try:
        actor = start_server(cfg, name, resume, allow_config_change=allow_config_change)
        host = host or os.environ.get("TOKENMILL_HOST") or cfg.service.host
        port = port or int(os.environ.get("TOKENMILL_PORT", cfg.service.port))
        backend = Backend(actor)
        server = uvicorn.Server(
            uvicorn.Config(create_app(backend), host=host, port=port, log_level="warning")
        )
        # Our handlers (above) stay: uvicorn installs none when it runs off the main thread.
        threading.Thread(target=server.run, name="tokenmill-api", daemon=True).start()
        url = f"http://{host}:{port}"
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "api": url}
        record.parent.mkdir(parents=True, exist_ok=True)
        gcs = ray.get_runtime_context().gcs_address
        record.write_text(json.dumps(owner | {"name": name, "address": gcs}) + "\n")
        rejects = RejectsFile(cfg.service.rejects)
        print(f"tokenmill: serving {name!r} (namespace {NAMESPACE}), API on {url}, Ray at {gcs}"
              + ("" if api_token() else " (mutations disabled: no TOKENMILL_API_TOKEN)"), flush=True)  # fmt: skip
        try:
            code = _watch(backend, owner, rejects, stop, linger_s)
        finally:
            server.should_exit = True
    finally:
        if actor is not None:
            _close(actor)
        if record.exists() and json.loads(record.read_text()).get("pid") == os.getpid():
            record.unlink()
        shutdown(started)
    return code


def _watch(backend, owner: dict, rejects: RejectsFile, stop: threading.Event,
           linger_s: float) -> int:  # fmt: skip
    finished_at, last_print = None, 0.0
    while not stop.is_set():
        backend.call("heartbeat", owner)
        rejects.append(backend.call("drain_rejects"))
        st = backend.call("status")
        now = time.time()
        if now - last_print >= 10:
            last_print = now
            m = backend.call("metrics")
            print(f"  step {st['global_step']:>7}  {m['tokens_per_s']:>10,.0f} tok/s  "
                  f"packing {100 * m['packing_efficiency']:.2f}%  lag {m['queue_depth']}  "
                  f"rejects {m['rejects']}", flush=True)  # fmt: skip
        if st["state"] == STOPPING:
            print("tokenmill: stopped by request", flush=True)
            return 0
        if st["state"] == FAILED:
            print(f"tokenmill: the feed failed: {st['error']}", file=sys.stderr)
            return 1
        if st["state"] == FINISHED:
            m = backend.call("metrics")
            drained = all(r["lag"] == 0 or r["lost"] for r in m["ranks"].values())
            finished_at = finished_at or now
            if drained or now - finished_at > linger_s:
                print("tokenmill: data ended and ranks drained", flush=True)
                return 0
        stop.wait(1.0)
    print("tokenmill: signal received, stopping", flush=True)
    return 0


def _close(actor) -> None:
    """Stop production and reads (bounded wait), then remove the actor."""
    import ray

    try:
        ray.get(actor.request_stop.remote(), timeout=EXIT_GRACE_S)
        ray.get(actor.close.remote(), timeout=EXIT_GRACE_S)  # its reads end with it anyway
    except Exception:  # already gone, or slow to close: killing it is the end either way
        pass
    ray.kill(actor, no_restart=True)


# -- tokenmill stop / status ----------------------------------------------------------------


def _find(name: str, address: str | None):
    """Join the cluster of service `name` and return its actor handle."""
    import ray

    from service.cluster import client_address, connect

    if address is None:
        address = _recorded_address(name)
    connect(client_address(address))
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def run_status(name: str, address: str | None, as_json: bool = False) -> int:
    import ray

    from service.cluster import shutdown

    try:
        actor = _find(name, address)
        if actor is None:
            print(f"no tokenmill service named {name!r}", file=sys.stderr)
            return 1
        st = ray.get(actor.status.remote(), timeout=10)
        m = ray.get(actor.metrics.remote(), timeout=10)
    finally:
        shutdown(True)  # a client's shutdown disconnects it
    if as_json:
        print(json.dumps({"status": st, "metrics": m}, indent=2, default=str))
        return 0
    owner = st.get("owner") or {}
    print(f"service   {name}  {st['state']}  step {st['global_step']}  "
          f"up {st['uptime_s']:.0f}s  API {owner.get('api', '?')}")  # fmt: skip
    print(
        f"world     {st['world_size']}  connected {st['ranks_connected']}  lost {st['lost_ranks']}"
    )
    print(f"rate      {m['tokens_per_s']:,.0f} tok/s  packing {100 * m['packing_efficiency']:.2f}%  "
          f"held steps {m['held_steps']}/{m['prefetch']}  rejects {m['rejects']}")  # fmt: skip
    for r, v in m["ranks"].items():
        print(f"rank {r:>4}  next {v['next_step']:>7}  lag {v['lag']:>4}  "
              f"wait {v['wait_s_last_60s']:.2f}s/60s" + ("  LOST" if v["lost"] else ""))  # fmt: skip
    if st["error"]:
        print(f"error     {st['error']}")
    return 0


def run_stop(name: str, address: str | None, timeout_s: float = 15.0) -> int:
    """Ask the service to stop; its serve process drains and exits. Kill it if it does not."""
    import ray

    from service.cluster import shutdown

    try:
        actor = _find(name, address)
        if actor is None:
            print(f"no tokenmill service named {name!r}", file=sys.stderr)
            return 1
        with contextlib.suppress(Exception):
            ray.get(actor.request_stop.remote(), timeout=5)
        pid = _local_serve_pid(name)
        if pid is not None:  # its Ray may go with it: watch the process, not the cluster
            shutdown(True)
            deadline = time.time() + timeout_s
            while time.time() < deadline and _alive(pid):
                time.sleep(0.25)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                print(f"tokenmill: {name!r} did not exit within {timeout_s:.0f}s; killed pid {pid}")
            else:
                print(f"tokenmill: stopped {name!r}")
            return 0
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                print(f"tokenmill: stopped {name!r}")
                return 0
            time.sleep(0.25)
        ray.kill(actor, no_restart=True)
        print(f"tokenmill: {name!r} did not exit within {timeout_s:.0f}s; killed its actor")
        return 0
    finally:
        shutdown(True)


def _recorded_address(name: str) -> str | None:
    """The Ray address in service `name`'s record, unless the record is stale (its serve
    process ran on this machine and is gone: a SIGKILL leaves the file behind)."""
    try:
        rec = json.loads(service_file(name).read_text())
    except (OSError, ValueError):
        return None
    if rec.get("host") == socket.gethostname() and _local_serve_pid(name) is None:
        service_file(name).unlink(missing_ok=True)
        return None
    return rec.get("address")


def _local_serve_pid(name: str) -> int | None:
    """The pid of service `name`'s serve process if it runs on this machine."""
    try:
        rec = json.loads(service_file(name).read_text())
    except (OSError, ValueError):
        return None
    pid = rec.get("pid")
    if rec.get("host") == socket.gethostname() and isinstance(pid, int) and _alive(pid):
        return pid
    return None


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
