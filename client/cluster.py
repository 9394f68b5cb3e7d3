"""Connecting to Ray: a cluster named on purpose, or a new, private local one.

Isolation. Without an address (`--address`, `TOKENMILL_RAY_ADDRESS` or `RAY_ADDRESS`) every
command starts its own local Ray (`ray.init(address="local")`). It never joins a cluster it
happens to find: a workstation where someone once ran `ray start` (a stale
`ray_current_cluster` file is enough) or a CI machine shared with other jobs would otherwise
hand us a foreign cluster, on which `num_cpus` is refused. `--address auto` joins the cluster
Ray finds, on purpose. Once tokenmill shuts its Ray down, Ray's implicit `ray.init` on the
next API call is switched off, so a leftover background thread raises instead of quietly
joining some other cluster.

Token authentication (Ray 2.5x). A cluster started with `RAY_AUTH_MODE=token` refuses clients
without its token, and Ray itself only looks for one when the mode is set by hand or the
address is found automatically. A driver in token mode against a cluster *without* auth is
no better: every actor it creates is cancelled before it runs. So the client follows the
cluster (`follow_auth`): one gRPC call to its GCS without a token (5 s at most) says whether
it uses token auth; if so we turn token mode on with the token where Ray documents it
(`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`) and ask once more, so that an
unreachable cluster, a missing token and a wrong token each get one line that says what to do
instead of Ray's 20 s of retries; if not, token mode stays off (RAY_AUTH_MODE=token set by
hand is overridden, with a warning).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from client.records import live_records, read_record, recorded_address
from wire.protocol import NAMESPACE

# Every Ray worker runs one tokenizer thread: Ray already runs one worker per core, and a
# rayon pool per worker would oversubscribe the cores.
WORKER_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PROBE_TIMEOUT_S = 5.0
_TOKEN_HELP = (
    "put the cluster's token in ~/.ray/auth_token, or set RAY_AUTH_TOKEN (the token) or "
    "RAY_AUTH_TOKEN_PATH (a file holding it); `ray get-auth-token` on the head node prints it"
)


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached or refuses us; the message says what to do."""


def requested_address(address: str | None) -> str | None:
    """The address the user asked for, in order: argument, TOKENMILL_RAY_ADDRESS, RAY_ADDRESS.
    None means: start a private local Ray. (Under `ray job submit` the supervisor sets
    RAY_ADDRESS, so the job joins its own cluster.)"""
    for value in (address, os.environ.get("TOKENMILL_RAY_ADDRESS"), os.environ.get("RAY_ADDRESS")):
        if value:
            return value
    return None


def client_address(address: str | None, service: str | None = None) -> str:
    """The cluster a client (a trainer rank, an adapter, `tokenmill stop/status`) joins, by
    one rule: the address named (`address`); else service `service`'s record on this
    machine (`client.records`: what `serve` wrote); else TOKENMILL_RAY_ADDRESS or
    RAY_ADDRESS; else the only Ray cluster running on this machine. Several is an error that
    lists them with the services recorded on each, never a guess."""
    if address:
        return address
    if service is not None:
        recorded = recorded_address(service)
        if recorded:
            return recorded
    named = requested_address(None)
    if named:
        return named
    from ray._private.services import find_gcs_addresses

    found = sorted(find_gcs_addresses())
    if len(found) == 1:
        return found[0]
    wanted = f"service {service!r}" if service else "tokenmill"
    if not found:
        raise ClusterError(
            f"no Ray cluster runs on this machine and no record of {wanted} is here: start "
            "`tokenmill serve` first, or pass the address of the cluster that runs it "
            "(address=..., --address, or RAY_ADDRESS)"
        )
    running: dict[str, list[str]] = {}
    for name, rec in live_records().items():
        running.setdefault(str(rec.get("address")), []).append(name)
    listed = "; ".join(
        f"{a} (services: {', '.join(running[a])})" if a in running else f"{a} (no service recorded)"
        for a in found
    )
    raise ClusterError(
        f"no record of {wanted} on this machine, and {len(found)} Ray clusters run here: "
        f"{listed}. Name the service that runs (service=...) or the cluster "
        "(address=..., --address, or RAY_ADDRESS)"
    )


def wait_for_cluster(address: str | None, service: str, deadline: float) -> str:
    """The cluster to join (`client_address`), waiting until `deadline` (a `time.time()`)
    for a `serve` that is starting (its record claimed, its Ray not up yet) rather than
    failing at once: trainers and `tokenmill status` may be launched together with `serve`.
    Says what it waits for every 10 s."""
    told = time.time()
    while True:
        try:
            rec = None if address else read_record(service)
            if rec is not None and not rec.get("address"):  # claimed: its Ray is starting
                raise ClusterError(f"its serve (pid {rec.get('pid')}) is starting its Ray")
            return client_address(address, service)
        except ClusterError as e:
            if time.time() >= deadline:
                raise
            if time.time() - told >= 10:
                told = time.time()
                print(f"tokenmill: waiting for service {service!r} to start: {e}",
                      file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(0.5)


def auth_token_available() -> bool:
    """Whether a Ray auth token is where Ray documents it."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    candidates = [Path(path).expanduser()] if path else [Path.home() / ".ray" / "auth_token"]
    return any(p.is_file() and p.stat().st_size > 0 for p in candidates)


def enable_token_auth() -> None:
    """Token mode on when a token is available and the user has not chosen a mode.

    Set in our environment, so child processes (torchrun ranks) inherit it. A cluster without
    authentication ignores the token."""
    if os.environ.get("RAY_AUTH_MODE") is None and auth_token_available():
        _token_mode()


def _token_mode() -> None:
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()  # sets RAY_AUTH_MODE=token and reloads Ray's cached config


def follow_auth(gcs: str) -> None:
    """Use the auth the cluster at `gcs` uses, decided by asking it (one call without a token).

    A cluster with token auth gets our token (ClusterError if there is none, or it is refused,
    or RAY_AUTH_MODE=disabled was asked for). A cluster without it gets no token mode: a driver
    in token mode against such a cluster has every actor it creates cancelled before it runs,
    so RAY_AUTH_MODE=token set by hand is overridden for this process, saying so."""
    import logging

    asked = os.environ.get("RAY_AUTH_MODE")
    with _auth_mode("disabled"):
        needs_token = probe(gcs, allow_unauthenticated=True)
    if needs_token:
        if asked is not None and asked.lower() == "disabled":
            raise ClusterError(
                f"the Ray cluster at {gcs} requires token authentication but "
                "RAY_AUTH_MODE=disabled is set: unset it"
            )
        if not auth_token_available():
            raise ClusterError(
                f"the Ray cluster at {gcs} requires an auth token and none was found: {_TOKEN_HELP}"
            )
        _token_mode()
        probe(gcs)  # the token itself: refused names it
        return
    if asked is not None and asked.lower() == "token":
        logging.getLogger("tokenmill").warning(
            "the Ray cluster at %s does not use token authentication: RAY_AUTH_MODE=token is "
            "ignored (a driver in token mode has its actors cancelled there); unset it",
            gcs,
        )
    _set_auth_mode("disabled")


@contextlib.contextmanager
def _auth_mode(mode: str) -> Iterator[None]:
    """RAY_AUTH_MODE=`mode` for this process while in the block (Ray reads it into its cached
    config, which is reloaded on both ways)."""
    before = os.environ.get("RAY_AUTH_MODE")
    _set_auth_mode(mode)
    try:
        yield
    finally:
        _set_auth_mode(before)


def _set_auth_mode(mode: str | None) -> None:
    from ray._raylet import Config  # type: ignore[attr-defined]  # a Cython module

    if mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")


def gcs_address(address: str) -> str | None:
    """host:port of the GCS that `address` names (resolving `auto`); None for `ray://`."""
    if address.startswith("ray://"):
        return None
    from ray._private.services import canonicalize_bootstrap_address_or_die

    return canonicalize_bootstrap_address_or_die(address)


def probe(
    address: str, timeout_s: float = PROBE_TIMEOUT_S, allow_unauthenticated: bool = False
) -> bool:
    """One gRPC call to the GCS at `address`; raises ClusterError with advice on failure.
    With `allow_unauthenticated`, a refusal for want of a token returns True instead (the
    cluster uses token auth); False: the call was answered."""
    import grpc
    from ray._private.gcs_utils import create_gcs_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = create_gcs_channel(address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        # protobuf builds the message classes at import time: mypy cannot see them.
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]
        stub.GetClusterId(request, timeout=timeout_s)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            if allow_unauthenticated:
                return True
            if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
                what = "requires token authentication but RAY_AUTH_MODE=disabled is set: unset it"
            elif auth_token_available():
                what = f"refused our auth token (a different cluster's?): {_TOKEN_HELP}"
            else:
                what = f"requires an auth token and none was found: {_TOKEN_HELP}"
            raise ClusterError(f"the Ray cluster at {address} {what}") from None
        why = (
            f"within {timeout_s:.0f}s"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else f"({code.name if code else e})"
        )
        raise ClusterError(
            f"no Ray cluster answers at {address} {why}; check the address "
            "(`ray status` on the head node prints it)"
        ) from None
    finally:
        channel.close()
    return False


def connect(
    address: str | None = None,
    object_store_memory: int | None = None,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
) -> bool:
    """Join the cluster the user named, or start a private local Ray (with custom `resources`,
    if given). Once per process.

    Returns True if this call started a local Ray (the caller shuts it down with `shutdown`)."""
    import ray

    _auto_init(False)  # explicit ray.init only, here and after `shutdown`
    if ray.is_initialized():
        return False
    address = requested_address(address)
    # No job-level runtime_env: with one, a job cannot use the workers Ray prestarts, and its
    # first two tasks took 2.3 s instead of 1.0 s after a cold `ray.init` here. The tokenizing
    # task sets WORKER_ENV itself (reading.read_tokenize_batch); a local Ray's workers also
    # inherit it from here. Nor usage stats: Ray Data would start an actor (a whole worker
    # process) per cluster to collect them; RAY_USAGE_STATS_ENABLED=1 opts back in.
    for key, value in {**WORKER_ENV, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = dict(
        namespace=NAMESPACE,
        log_to_driver=os.environ.get("TOKENMILL_RAY_LOGS", "0") == "1",
        configure_logging=False,
    )
    if address:
        gcs = gcs_address(address)
        if gcs:
            follow_auth(gcs)
        else:  # ray:// (Ray Client): no GCS to ask; a token, where there is one, is sent
            enable_token_auth()
        ray.init(address=gcs or address, **kwargs)
        return False
    if object_store_memory is None:
        object_store_memory = int(os.environ.get("TOKENMILL_OBJECT_STORE_BYTES", 1 << 30))
    if os.environ.get("RAY_AUTH_MODE") is None:
        # What Ray does for a new local cluster anyway (token auth, a token generated in
        # ~/.ray/auth_token if none exists), said explicitly: without its warning on every
        # start, and inherited by our child processes (torchrun ranks).
        _token_mode()
    ray.init(
        address="local",
        num_cpus=num_cpus or usable_cpus(),
        object_store_memory=object_store_memory,
        include_dashboard=False,
        resources=resources,
        **kwargs,
    )
    return True


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (`taskset`, a container's cpuset),
    not the machine's count, so an embedded Ray confined to N cores schedules N tasks."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def jobs_alive() -> dict[str, bool]:
    """The cluster's Ray jobs (the GCS's job table): job id -> whether its driver is still
    connected. Raises where the GCS cannot be read; each caller says what that means to it."""
    from ray._private import state

    return {job["JobID"]: not job["IsDead"] for job in state.jobs()}


def connect_in_background(address: str | None = None) -> Future:
    """`connect` on a thread: the future holds its result (or its error, e.g. ClusterError).

    Importing Ray and starting a local one takes 3-9 s on 2 cores; an export spends that
    time tokenizing its first units instead of waiting (reading.with_head_start)."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(connect(address))
        except BaseException as e:  # carried to whoever waits on the future
            done.set_exception(e)
            return
        # The thread must outlive the run: Ray starts a local cluster's processes with
        # PR_SET_PDEATHSIG, which fires when the *thread* that spawned them ends. (Measured:
        # the raylet was killed a few seconds in, and the driver exited with status 1.)
        threading.Event().wait()

    threading.Thread(target=run, name="tokenmill-connect", daemon=True).start()
    return done


def shutdown(started: bool) -> None:
    """Leave Ray: shut it down if we started it, and never let a straggling thread re-init."""
    import ray

    if started:
        ray.shutdown()
    _auto_init(False)


def _auto_init(enabled: bool) -> None:
    """Ray calls `ray.init()` (joining whatever it finds) on the first API call of a process
    that is not connected. We never want that once our own Ray is gone."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = enabled
