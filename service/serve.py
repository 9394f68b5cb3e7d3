"""`tokenmill serve`, `stop` and `status`: the service's lifecycle.

`serve` starts the batch-server actor (owned by this process: when the process dies, Ray
removes the actor with it), the control API, and a one-second loop that beats the actor's
heartbeat, appends skipped records to the rejects file and watches for the end. It exits on
SIGTERM or Ctrl-C, on `tokenmill stop`, when the feed fails, or at the end of the data once
nothing depends on it any more:
- every rank of the world has been told the end (it asked past the last step, so it has
  trained on every step it fetched), or is lost (no sign of life for rank_timeout_s);
- and, when this process started Ray itself (embedded), every rank's process has left that
  Ray: a rank's Ray client dies with its cluster ("Failed to connect to GCS"), also after its
  last step, while it saves its checkpoint.
Before any rank connects, the end of the data ends nothing: a late rank still finds every
step. Exiting stops production, closes the feed's reads and the actor, and takes a few seconds.

A service named N also leaves a record (`client.records`: the Ray address, the pid, the API
URL), claimed atomically before it starts, so that `tokenmill stop/status --name N`,
`Feed.connect` and the adapters find it without an address, and a second `serve --name N`
on the machine is refused. The record is removed on exit; a stale one is ignored.
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
from typing import TYPE_CHECKING

from client.cluster import jobs_alive
from client.records import (
    ServiceExists,
    alive,
    claim,
    live_records,
    local_pid,
    publish,
    read_record,
    release,
    start_time,
)
from client.records import service_file as service_file
from pipeline.config import REVEAL_SECRETS, Config
from pipeline.lanes.placing import wait_placed
from service.batch_server import BatchServer
from wire.protocol import CONCURRENCY_GROUPS, FAILED, NAMESPACE, SERVICE_NAME, STOPPING

if TYPE_CHECKING:
    from pipeline.feed import LeaveOut

STALE_BEAT_S = 10.0  # a service whose serve process has not beaten for this long is stale
EXIT_GRACE_S = 2.0


def start_server(cfg: Config, name: str = SERVICE_NAME, resume: dict | None = None,
                 prefetch: int | None = None, allow_config_change: bool = False,
                 pool: bool = False, leave_out: LeaveOut | None = None):  # fmt: skip
    """Launch the named batch-server actor, owned by this process, and wait until it answers.
    `pool`: tokenize on the cluster's warm pool (as an export joining a running cluster does).

    A service of that name whose `serve` process is gone (no heartbeat for STALE_BEAT_S, or
    an actor that no longer answers) is removed first; a live one is an error.

    A server whose process is lost before it answered (killed by the OS, its node lost: not
    an error its constructor raised) is started again once. Nothing was handed out yet, so
    a second start is the same service; a second loss is the error."""
    from ray.exceptions import ActorDiedError

    _remove_if_stale(name)
    args = (cfg.model_dump(mode="json", context=REVEAL_SECRETS), resume, prefetch, 10_000,
            cfg.service.rank_timeout_s, allow_config_change, pool, leave_out)  # fmt: skip
    try:
        return _start_once(cfg, name, args)
    except ActorDiedError as e:
        if e.actor_init_failed:  # the constructor raised: starting again would raise again
            raise
        print(f"tokenmill: the batch server {name!r} was lost while it started; starting it "
              f"again ({str(e).splitlines()[-1]})", file=sys.stderr, flush=True)  # fmt: skip
    _wait_name_free(name)
    return _start_once(cfg, name, args)


def _start_once(cfg: Config, name: str, args: tuple):
    import ray

    # ray's stubs type only the task options here; the actor options are valid at run time.
    actor_class = ray.remote(  # type: ignore[call-overload]
        num_cpus=0,
        max_concurrency=16,
        concurrency_groups=dict(CONCURRENCY_GROUPS),
        max_restarts=0,
    )(BatchServer)
    control = cfg.service.control_resources
    asks = cfg.service.resources if control is None else control
    placement = {"resources": dict(asks)} if asks else {}
    since = time.monotonic()
    actor = actor_class.options(name=name, namespace=NAMESPACE, **placement).remote(*args)
    # Placed and started (its lanes too): a server no node can hold fails naming what it
    # asks, instead of waiting for ever. Its lanes are placed while it starts, each within the
    # same limit: the server's own wait allows both (twice service.place_timeout_s).
    limit = cfg.service.place_timeout_s
    whence = "service.place_timeout_s"
    if limit is not None and cfg.lanes > 1:
        limit, whence = limit * 2, f"twice service.place_timeout_s {limit:g} s: it, then its lanes"
    first = actor.status.remote()
    try:
        wait_placed(first, f"the batch server {name!r}", asks, limit, since, whence)
        ray.get(first)
    except BaseException:
        ray.kill(actor)  # a server left waiting to be placed would hold its name
        raise
    return actor


def _wait_name_free(name: str, timeout_s: float = 10.0) -> None:
    """Waits until no actor holds `name` (a killed actor's name is released once it is dead)."""
    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)


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
    _wait_name_free(name)


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
              linger_s: float = 5.0, allow_config_change: bool = False,
              leave_out: LeaveOut | None = None) -> int:  # fmt: skip
    import ray
    import uvicorn

    from client.cluster import connect, shutdown
    from service.api import Backend, api_token, create_app

    host = host or os.environ.get("TOKENMILL_HOST") or cfg.service.host
    port = port if port is not None else int(os.environ.get("TOKENMILL_PORT", cfg.service.port))
    # The API's socket is bound before anything is recorded: a port that is taken fails the
    # serve at once, naming who holds it, instead of a service without an API whose record
    # names the other service's port. Port 0 binds a free one; the record has the real one.
    sock = bind_api(host, port)
    try:
        record = claim(name)  # before Ray: a second `serve --name N` here is refused at once
    except BaseException:
        sock.close()
        raise
    try:
        started = connect(address)
    except BaseException:
        release(record)
        sock.close()
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    actor = None
    try:
        # A running cluster (joined, not started here) gets the warm pool, as an export does.
        actor = start_server(cfg, name, resume, allow_config_change=allow_config_change,
                             pool=not started, leave_out=leave_out)  # fmt: skip
        port = sock.getsockname()[1]
        backend = Backend(actor)
        server = uvicorn.Server(
            uvicorn.Config(create_app(backend), host=host, port=port, log_level="warning")
        )
        # Our handlers (above) stay: uvicorn installs none when it runs off the main thread.
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tokenmill-api",
                         daemon=True).start()  # fmt: skip
        url = f"http://{host}:{port}"
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "api": url}
        gcs = ray.get_runtime_context().gcs_address
        publish(record, owner | {"name": name, "address": gcs, "started": start_time(os.getpid())})
        rejects = RejectsFile(cfg.service.rejects)
        print(f"tokenmill: serving {name!r} (namespace {NAMESPACE}), API on {url}, Ray at {gcs}"
              + ("" if api_token() else " (mutations disabled: no TOKENMILL_API_TOKEN)"), flush=True)  # fmt: skip
        try:
            code = _watch(backend, owner, rejects, stop, linger_s, started)
        finally:
            server.should_exit = True
    finally:
        if actor is not None:
            _close(actor)
        release(record)
        shutdown(started)
    return code


class PortTaken(RuntimeError):
    """The API's port is held by another process."""


def bind_api(host: str, port: int) -> socket.socket:
    """A listening socket for the API on host:port (port 0: a free one); PortTaken naming the
    port and, where a service recorded here holds it, that service."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is free
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        holders = [f"service {n!r} (serve pid {r.get('pid')})" for n, r in live_records().items()
                   if str(r.get("api", "")).rsplit(":", 1)[-1] == str(port)]  # fmt: skip
        who = ", ".join(holders) or "another process"
        raise PortTaken(
            f"the API cannot listen on {host}:{port} ({e.strerror or e}): held by {who}; "
            "choose another with --port (0: any free port) or stop what holds it"
        ) from None
    return sock


def _watch(backend, owner: dict, rejects: RejectsFile, stop: threading.Event,
           linger_s: float, embedded: bool = False) -> int:  # fmt: skip
    """The serve loop: beat, write rejects, log every 10 s, and decide when to exit.

    At the end of the data, once every rank was told the end: it waits `linger_s` more (a
    rank may still ask for its final state or report its last loss), and on an embedded Ray
    until the ranks' processes have left it (their Ray client dies with it), logging why,
    until `tokenmill stop`. A call into the actor that times out (a busy control group) is
    retried; only an actor that is gone ends the loop."""
    import ray

    drained_at, last_print, last_why, slow_since = None, 0.0, "", None
    own_job = ray.get_runtime_context().get_job_id()
    signalled = False
    while True:
        if stop.is_set():  # SIGTERM, Ctrl-C: the first drains as `tokenmill stop` does
            if signalled:
                print("tokenmill: second signal: stopping now", flush=True)
                return 0
            signalled = True
            stop.clear()
            print("tokenmill: signal received: draining (every rank gets the steps made, then "
                  "its end); a second signal stops at once", flush=True)  # fmt: skip
            with contextlib.suppress(Exception):
                backend.call("request_stop")
        try:
            backend.call("heartbeat", owner)
            rejects.append(backend.call("drain_rejects"))
            st = backend.call("status")
            m = backend.call("metrics") if time.time() - last_print >= 10 else None
        except ray.exceptions.GetTimeoutError:
            slow_since = slow_since or time.time()
            if time.time() - slow_since > 60:
                print("tokenmill: the batch server has not answered for 60 s", file=sys.stderr)
                slow_since = time.time()
            stop.wait(1.0)
            continue
        slow_since = None
        now = time.time()
        if m is not None:
            last_print = now
            print(_progress_line(st, m), flush=True)
        if st["state"] == FAILED:
            print(f"tokenmill: the feed failed: {st['error']}", file=sys.stderr)
            return 1
        # The drain: at the end of the data, or after `tokenmill stop`, once every rank has had
        # its end, and on an embedded Ray once their processes left it (their Ray client
        # dies with it: a rank writing its final checkpoint must not lose its cluster).
        stopping = st["state"] == STOPPING
        if st.get("drained"):
            drained_at = drained_at or now
            left = _rank_jobs_alive(backend, own_job) if embedded else []
            if not left and now - drained_at >= (0.0 if stopping else linger_s):
                print("tokenmill: " + ("stopped by request" if stopping else "the data ended")
                      + ": every rank has taken its last step", flush=True)  # fmt: skip
                return 0
            why = (f"tokenmill: {'stopping' if stopping else 'the data ended'}; waiting for "
                   f"{len(left)} rank process(es) to leave this Ray before it stops "
                   "(a second signal ends it now)")  # fmt: skip
            if left and why != last_why and now - drained_at >= 5.0:
                print(why, flush=True)
                last_why = why
        elif stopping:
            waiting = st.get("ranks_to_end") or []
            if waiting:  # a rank whose process has gone will never take its end
                with contextlib.suppress(Exception):
                    backend.call(
                        "ranks_gone_with", [job for job, up in jobs_alive().items() if not up]
                    )
            why = f"tokenmill: stopping: ranks {waiting} still have steps made before the stop"
            if waiting and why != last_why and now - last_print >= 10:
                print(why, flush=True)
                last_why, last_print = why, now
        stop.wait(1.0)


def _progress_line(st: dict, m: dict) -> str:
    """One human line: where production is, what it does, and where the ranks are."""
    ranks = m.get("ranks") or {}
    consumed = [v["consumed_step"] for v in ranks.values() if v.get("consumed_step") is not None]
    where = (
        f"ranks at step {min(consumed)}" + (f"..{max(consumed)}" if max(consumed) != min(consumed) else "")
        if consumed
        else f"{st.get('ranks_connected', 0)} rank(s) connected"
    )  # fmt: skip
    lost = st.get("lost_ranks") or []
    # Lanes (`lanes` > 1) waiting to be placed, e.g. started again where no node has their
    # resources: their own note goes to the batch server's Ray log, not here.
    waiting = [f"lane {d['lane']} {d['waiting_s']:.0f}s" for d in m.get("lanes") or []
               if isinstance(d, dict) and d.get("waiting_s") is not None]  # fmt: skip
    restarts = len(m.get("lanes_restarted") or [])
    return (
        f"  produced {st['global_step']:>7} steps  {m.get('producer', st['state']):<11}  "
        f"{m['tokens_per_s']:>12,.0f} tok/s  trainers take {m.get('consumed_tokens_per_s') or 0:,.0f} tok/s  "
        f"packing {100 * m['packing_efficiency']:.2f}%  "
        f"{where}  rejects {m['rejects']}" + (f"  LOST ranks {lost}" if lost else "")
        + (f"  STALL: {m['stall']}" if m.get("stall") else "")
        + (f"  waiting to be placed: {', '.join(waiting)}" if waiting else "")
        + (f"  lane restarts {restarts}" if restarts else "")
    )  # fmt: skip


def _rank_jobs_alive(backend, own_job: str) -> list[str]:
    """The Ray jobs of ranks still connected to this (embedded) cluster; not this process's
    own (ranks that are threads of `serve` leave with it). A job table that cannot be read
    counts as "not known to have left": the wait goes on."""
    jobs = set(backend.call("rank_jobs")) - {own_job}
    if not jobs:
        return []
    try:
        alive = jobs_alive()
    except Exception:
        return sorted(jobs)
    return sorted(job for job in jobs if alive.get(job, False))


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


def _find(name: str, address: str | None, wait_s: float = 0.0):
    """Join the cluster of service `name` (found as a rank finds it: `client_address`) and
    return its actor handle, or None. A service that is starting (its record claimed, its
    Ray or its actor not up yet) is waited for up to `wait_s`, saying so every 10 s."""
    import ray

    from client.cluster import connect, requested_address, wait_for_cluster
    from client.records import live_records

    deadline = time.time() + wait_s
    if address is None and read_record(name) is None and requested_address(None) is None:
        others = sorted(live_records())
        print(f"no tokenmill service named {name!r} is recorded on this machine"
              + (f" (running here: {', '.join(others)})" if others else "")
              + "; pass --address to look for it on another cluster", file=sys.stderr)  # fmt: skip
        return None
    connect(wait_for_cluster(address, name, deadline))
    told = time.time()
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.time() >= deadline:
                print(f"no tokenmill service named {name!r}", file=sys.stderr)
                return None
            if time.time() - told >= 10:
                told = time.time()
                print(f"tokenmill: waiting for service {name!r} to start", file=sys.stderr)
            time.sleep(0.25)


def run_status(name: str, address: str | None, as_json: bool = False, wait_s: float = 0.0) -> int:
    import ray

    from client.cluster import shutdown

    try:
        actor = _find(name, address, wait_s)
        if actor is None:
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
    # A rank that said hello counts as connected; `live`: neither lost nor left.
    live = st["ranks_connected"] - len(st["lost_ranks"]) - len(st.get("left_ranks") or [])
    print(f"world     {st['world_size']}  ranks connected {st['ranks_connected']}: live {live}, "
          f"lost {st['lost_ranks'] or 'none'}"
          + (f", left {st['left_ranks']}" if st.get("left_ranks") else ""))  # fmt: skip
    print(f"rate      made {m['tokens_per_s']:,.0f} tok/s  trainers take "
          f"{m.get('consumed_tokens_per_s') or 0:,.0f} tok/s  packing "
          f"{100 * m['packing_efficiency']:.2f}%  held steps {m['held_steps']}/{m['prefetch']}  "
          f"rejects {m['rejects']}")  # fmt: skip
    if m.get("stall"):
        print(f"STALL     {m['stall']}")
    print(f"producer  {m.get('producer', '?')}")
    for r, v in m["ranks"].items():
        at = v.get("consumed_step")
        sign = v.get("last_sign_s_ago")
        print(f"rank {r:>4}  at step {'?' if at is None else at:>7}  fetched {v['next_step']:>7}  "
              f"lag {v['lag']:>4}  seen {'-' if sign is None else f'{sign:.0f}s ago'}  "
              f"wait {v['wait_s_last_60s']:.2f}s/60s"
              + (f"  WAITING {v['waiting_s']:.0f}s" if v.get("waiting_s") is not None else "")
              + ("  LOST" if v["lost"] else "") + ("  left" if v.get("left") else "")
              + ("  ended" if v.get("ended") else ""))  # fmt: skip
    if st["error"]:
        print(f"error     {st['error']}")
    return 0


def run_stop(name: str, address: str | None, timeout_s: float = 600.0, now: bool = False) -> int:
    """Ask the service to stop; its serve process drains (every rank gets the steps made,
    then its end; `now`: its end at once) and exits once every rank had its end and, on the
    serve's own Ray, left it. Killed if it has not exited within `timeout_s`."""
    import ray

    from client.cluster import shutdown

    try:
        actor = _find(name, address)
        if actor is None:
            return 1
        with contextlib.suppress(Exception):
            ray.get(actor.request_stop.remote(now), timeout=5)
        rec = read_record(name)
        pid = None if rec is None else local_pid(rec)
        if pid is not None:  # its Ray may go with it: watch the process, not the cluster
            shutdown(True)
            t0 = told = time.time()
            while time.time() < t0 + timeout_s and alive(pid):
                if time.time() - told >= 15:
                    told = time.time()
                    print(f"tokenmill: {name!r} drains: its ranks take their last steps "
                          f"({told - t0:.0f}s; `stop --now` ends them at once)", flush=True)  # fmt: skip
                time.sleep(0.25)
            if alive(pid):
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
