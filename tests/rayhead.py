"""A separate `ray start --head` cluster for a test: its own temp dir and ports, stopped by
its own process group (never `ray stop`, which ends every Ray on the machine)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patient(seconds: float) -> float:
    """A deadline for a process to start (a Ray head, a service), given as it is on a quiet
    machine, stretched by how busy this one is: times its 1-minute load per core, from 1 to 5.
    Two busy loops beside the suite on 2 cores put a `ray start --head` past 90 s."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(5.0, max(1.0, load))


def wait_listening(port: int, timeout: float = 120.0, alive=None) -> None:
    """Until something listens on `port` (`timeout` as `patient` stretches it); ChildProcessError
    if `alive` (a Popen) exits first."""
    deadline = time.time() + patient(timeout)
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return
        except OSError:
            if alive is not None and alive.poll() is not None:
                raise ChildProcessError(f"the process exited ({alive.returncode})") from None
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {port}")


def wait_said(path: Path, text: str, timeout: float = 120.0, alive=None) -> None:
    """Until the file at `path` holds `text` (`timeout` as `patient` stretches it);
    ChildProcessError if `alive` (a Popen) exits first."""
    deadline = time.time() + patient(timeout)
    while time.time() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if alive is not None and alive.poll() is not None:
            raise ChildProcessError(f"the process exited ({alive.returncode})")
        time.sleep(0.5)
    raise TimeoutError(f"{path} did not say {text!r}")


def wait_http(url: str, timeout: float = 120.0) -> dict:
    """The JSON `url` answers, once it answers (`timeout` as `patient` stretches it)."""
    import json
    import urllib.request

    deadline = time.time() + patient(timeout)
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


@contextlib.contextmanager
def serve_process(config, address: str, name: str, cwd, env: dict | None = None):
    """`python -m service serve` in a subprocess (in `cwd`, where its rejects file goes),
    up once /healthz answers; SIGTERMed at the end. Yields {address, port, name, proc}."""
    from tests.conftest import warm_cache

    warm_cache()  # a serve given `env` without a cache of its own loads the tokenizer from it
    port = free_port()
    # Its output goes to a file, never to a pipe nobody reads: a full pipe (64 KB) blocks the
    # service on its next print, and its HTTP API with it.
    log = Path(cwd) / f"serve-{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--config", str(config), "--address",
             address, "--port", str(port), "--name", name],
            env=env or os.environ, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=cwd,
        )  # fmt: skip
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
        except TimeoutError:
            proc.kill()
            proc.wait()
            raise AssertionError(log.read_text()[-3000:]) from None
        yield {"address": address, "port": port, "name": name, "proc": proc, "log": log}
    finally:
        if proc.poll() is None:
            # The first SIGTERM drains: it waits for ranks still connected (a test's own feed,
            # never closed); a second one, a moment later, ends serve at once.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


STARTED = "Ray runtime started."  # what `ray start` says once its node is up
START_ATTEMPTS = 8  # how often the suite starts a Ray node that gave up (`starts_over`)


def starts_over(attempt: int, deadline: float) -> bool:
    """Whether a Ray node's start that failed at `attempt` is the last one: the suite starts a
    node again once whatever the load, and then while `deadline` (time.monotonic()) lasts, up
    to START_ATTEMPTS times. (`ray start` gives its raylet 30 s to register, a constant in
    ray/_private/node.py, which a loaded machine exceeds.)"""
    return attempt >= START_ATTEMPTS or (attempt >= 2 and time.monotonic() > deadline)


@contextlib.contextmanager
def ray_head(env: dict, dashboard: bool = False, temp: str | None = None):
    """Yields {"gcs", "dashboard", "temp"}; `temp` is the cluster's --temp-dir (short: AF_UNIX
    paths are <= 107 bytes), where it also writes its `ray_current_cluster` file."""
    from tests.conftest import warm_cache

    warm_cache()  # the cluster's workers load the tokenizer from this process's cache
    own = temp is None
    temp = temp or tempfile.mkdtemp(prefix="tm", dir="/tmp")
    # Ports are picked free and then bound by `ray start`: another process may take one in
    # between. A head that exits while starting, or whose port (the dashboard's) does not
    # open, is stopped and started again with new ports: once, and on a loaded machine while
    # `patient(150)` lasts. `ray start` gives its raylet 30 s to register (a constant in
    # ray/_private/node.py) and exits past it: under the load check (two busy loops beside
    # the suite, load average ~17) a head came up at its second attempt, after 134 s.
    deadline = time.monotonic() + patient(150)
    for attempt in range(1, START_ATTEMPTS + 1):
        gcs, dash = free_port(), free_port()
        # What `ray start` says goes to a file in its temp dir: why a head did not come up.
        os.makedirs(temp, exist_ok=True)
        log = open(f"{temp}/start-{attempt}.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
             "--num-cpus=1", "--object-store-memory=200000000", f"--include-dashboard={str(dashboard).lower()}",
             f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}",
             # Its own agent ports: another cluster may hold the defaults (52365...), and a
             # second agent that cannot bind leaves "No available agent to submit job".
             f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )  # fmt: skip
        try:
            wait_listening(dash if dashboard else gcs, timeout=patient(90), alive=proc)
            # The GCS listens before the head's raylet has registered with it: a driver that
            # joins in between fails ("Failed to connect to Ray cluster", seen on a loaded
            # machine). `ray start` says so once its node is up.
            wait_said(Path(log.name), STARTED, timeout=patient(90), alive=proc)
            break
        except (ChildProcessError, TimeoutError) as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
            said = Path(log.name).read_text(errors="replace")[-3000:]
            print(f"ray start --head, attempt {attempt}: {e}\n{said}", file=sys.stderr)
            if starts_over(attempt, deadline):
                raise TimeoutError(
                    f"ray start --head did not come up, {attempt} times: {e}\n{said}"
                ) from None
    try:
        yield {"gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dash}", "temp": temp}
    finally:
        stop_group(proc)
        log.close()
        if own:
            shutil.rmtree(temp, ignore_errors=True)


def stop_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Stop a `ray start --block` and everything it started: SIGTERM its process group, a
    short grace, then SIGKILL to the group and to every descendant (Ray's workers run in
    process groups of their own). A test cluster keeps nothing worth a graceful stop: Ray's
    own took ~34 s a cluster here, three clusters a run."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=10)
