"""Separate hosts on this one machine: each a Linux network namespace with its own address,
joined by a bridge in a namespace of its own, running its own Ray node.

What crosses the network between them really does: the GCS address, object transfers, the
REST API, discovery. 127.0.0.1 stays inside a host. The hosts' subnet is private to them (the
machine's own namespace has no route to it, and the bridge no way out), so no traffic leaves
the project's test hosts. Each host has a default route through its link: Ray finds a node's
address the way it does on a real host (the interface a route out would use), so a driver on
a host uses that host's own raylet.

    Hosts(["head", "data0", "data1", "trainer"])  ->  namespaces tm<tag>-head, ..., tm<tag>-br
      head 10.<a>.<b>.1   data0 .2   data1 .3   trainer .4   (one /24, one bridge)

`host.run(cmd)` starts a process on a host; `host.kill()` kills every process of the host (a
host lost: its raylet, object store, workers and drivers); `close()` tears it all down.
Needs root (or CAP_NET_ADMIN): `available()` says why not, and a test skips with that.

By hand (a demo): `./dev hosts` brings up a head and two data hosts and prints how to run
`tokenmill serve` and a trainer on them; Ctrl-C tears them down.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.rayhead import START_ATTEMPTS, STARTED, patient, starts_over, wait_said

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 6379  # every host has ports of its own: Ray's defaults clash with nobody
MB = 1 << 20
# Variables that would send a process to some other cluster, or pin an auth mode.
UNSET = ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
         "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR")  # fmt: skip


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def available() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"tmprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except OSError as e:
        return f"cannot add a network namespace (needs root or CAP_NET_ADMIN): {e}"
    _ip("netns", "del", name)
    return None


class Host:
    def __init__(self, hosts: Hosts, name: str, ip: str):
        self.hosts, self.name, self.ip = hosts, name, ip
        self.ns = f"{hosts.prefix}-{name}"
        self.temp = tempfile.mkdtemp(prefix=f"tm{name[:3]}", dir="/tmp")  # AF_UNIX: short
        self.procs: list[subprocess.Popen] = []
        self.init: int | None = None
        self.init_proc: subprocess.Popen | None = None

    def run(self, cmd: list[str], log: Path | str, env: dict | None = None,
            **kw) -> subprocess.Popen:  # fmt: skip
        """Start `cmd` on this host (in its namespace), output appended to `log`."""
        with open(log, "a") as out:
            proc = subprocess.Popen(
                [*self.enter(), *cmd], env=env or self.hosts.env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def enter(self) -> list[str]:
        """The command prefix that runs a command on this host: its network namespace, and a
        PID namespace of its own (with its own /proc), so that a process there sees only the
        host's processes, as on a real host: Ray's driver finds "its" raylet by listing the
        processes (services.find_node_ids), and would pick another host's otherwise."""
        if self.init is None:  # the host's first process, pid 1 of its PID namespace
            self.init_proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "unshare", "--pid", "--fork", "--mount-proc",
                 "sleep", "infinity"], start_new_session=True,
            )  # fmt: skip
            deadline = time.time() + patient(10)
            while self.init is None:
                import psutil

                kids = psutil.Process(self.init_proc.pid).children()
                if kids:
                    self.init = kids[0].pid
                elif time.time() > deadline:
                    raise OSError(f"host {self.name}: its first process did not start")
                else:
                    time.sleep(0.02)
        return ["nsenter", "-t", str(self.init), "-p", "-m", "-n", "--"]

    @property
    def ray_log(self) -> Path:
        return self.hosts.logs / f"ray-{self.name}.log"

    def start_ray(self, head: Host | None, cpus: int,
                  resources: dict | None = None) -> subprocess.Popen:  # fmt: skip
        """A Ray node on this host: the head when `head` is None, else joined to `head`."""
        join = (["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if head is None
                else [f"--address={head.ip}:{GCS_PORT}"])  # fmt: skip
        cmd = [RAY, "start", "--block", *join, f"--node-ip-address={self.ip}",
               f"--num-cpus={cpus}", f"--temp-dir={self.temp}",
               f"--object-store-memory={100 * MB}", f"--memory={2048 * MB}",
               f"--resources={json.dumps(resources or {})}"]  # fmt: skip
        return self.run(cmd, self.ray_log, env=self.hosts.ray_env)

    def pids(self) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def kill(self, keep_init: bool = False) -> None:
        """Every process of this host, at once (a host lost); with `keep_init`, all but its
        PID namespace's first, the host staying up (what a `ray start` that gave up left)."""
        keep = {self.init, self.init_proc.pid if self.init_proc else None} if keep_init else set()
        for _ in range(5):  # a dying process may leave a child that was forking
            pids = [p for p in self.pids() if p not in keep]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)


class Hosts:
    """The hosts named, up with their links (no Ray yet: `Host.start_ray`)."""

    def __init__(self, names: list[str], logs: Path, env: dict | None = None):
        self.prefix = f"tm{secrets.token_hex(2)}"
        a, b = 16 + secrets.randbelow(200), secrets.randbelow(250)
        self.logs = logs
        self.bridge = f"{self.prefix}-br"
        # Ray's token: the cluster's own. The nodes run in token mode; tokenmill's processes
        # get only the token's file and follow the cluster (client/cluster.py follow_auth).
        self.token = logs / "ray_token"
        self.token.write_text(secrets.token_hex(32))
        base = {k: v for k, v in (env or os.environ).items() if k not in UNSET}
        conftest = sys.modules.get("tests.conftest")
        if conftest is not None:  # under pytest: the hosts' processes find the tokenizer built
            conftest.warm_cache()
        path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
        self.env = base | {"RAY_AUTH_TOKEN_PATH": str(self.token), "PYTHONPATH": path}
        self.ray_env = self.env | {"RAY_AUTH_MODE": "token"}
        self.hosts: dict[str, Host] = {}
        try:
            _ip("netns", "add", self.bridge)
            _ip("link", "add", "br0", "type", "bridge", ns=self.bridge)
            _ip("link", "set", "br0", "up", ns=self.bridge)
            for i, name in enumerate(names):
                host = Host(self, name, f"10.{a}.{b}.{i + 1}")
                self.hosts[name] = host
                _ip("netns", "add", host.ns)
                # One veth pair: eth0 on the host, h<i> on the bridge.
                _ip("link", "add", "eth0", "netns", host.ns, "type", "veth",
                    "peer", "name", f"h{i}", "netns", self.bridge)  # fmt: skip
                _ip("link", "set", f"h{i}", "master", "br0", "up", ns=self.bridge)
                _ip("addr", "add", f"{host.ip}/24", "dev", "eth0", ns=host.ns)
                _ip("link", "set", "eth0", "up", ns=host.ns)
                _ip("link", "set", "lo", "up", ns=host.ns)
                _ip("route", "add", "default", "dev", "eth0", ns=host.ns)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def python(self, host: str, code: str, *args: str, timeout: float = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        """Run `python -c code args` on a host, waiting for it."""
        return subprocess.run(
            [*self[host].enter(), sys.executable, "-c", code, *args],
            env=env or self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        )  # fmt: skip

    def wait_nodes(self, n: int, host: str, timeout: float = 180) -> list[dict]:
        """Wait until `n` Ray nodes are alive, asking from `host` (`timeout` as `patient`
        stretches it); returns them."""
        timeout = patient(timeout)
        r = self.python(host, NODES, f"{self['head'].ip}:{GCS_PORT}", str(n), str(timeout),
                        timeout=timeout + 60)  # fmt: skip
        if r.returncode:
            raise AssertionError(f"the cluster did not come up: {r.stderr[-3000:]}\n{self.tails()}")
        found = json.loads(r.stdout.strip().splitlines()[-1])
        if len(found) < n:
            raise AssertionError(f"{len(found)} of {n} nodes came up: {found}\n{self.tails()}")
        return found

    def tails(self, n: int = 2000) -> str:
        logs = sorted(self.logs.glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in logs)

    def close(self) -> None:
        for host in reversed(list(self.hosts.values())):
            for proc in host.procs:  # SIGTERM first: `ray start --block` stops its node
                with contextlib.suppress(Exception):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 5
        while time.time() < deadline and any(h.pids() for h in self.hosts.values()):
            time.sleep(0.2)
        for host in self.hosts.values():
            host.kill()
            for proc in (*host.procs, *([host.init_proc] if host.init_proc else [])):
                with contextlib.suppress(Exception):
                    proc.wait(timeout=10)
            with contextlib.suppress(OSError):
                _ip("netns", "del", host.ns)
            shutil.rmtree(host.temp, ignore_errors=True)
        with contextlib.suppress(OSError):
            _ip("netns", "del", self.bridge)


# Joins the cluster the way tokenmill does and waits for `n` live nodes; prints them.
NODES = r"""
import json, sys, time
import ray
from client.cluster import ClusterError, connect
n, deadline = int(sys.argv[2]), time.time() + float(sys.argv[3])
while True:  # the head's GCS may not listen yet
    try:
        connect(sys.argv[1])
        break
    except ClusterError:
        if time.time() > deadline:
            raise
        time.sleep(0.5)
while True:
    alive = [x for x in ray.nodes() if x["Alive"]]
    if len(alive) >= n or time.time() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"id": x["NodeID"], "ip": x["NodeManagerAddress"], "resources": x["Resources"]}
                  for x in alive]))
"""


def _ray_up(starts: list[tuple[Host, Callable[[], subprocess.Popen]]]) -> None:
    """Start these hosts' Ray nodes, and wait until each says it is up. `ray start` gives its
    raylet 30 s to register with the GCS (a constant in ray/_private/node.py) and exits past
    it: under the load check (two busy loops beside the suite) a head did, and every node
    joining it with it. A node that exits before it is up is started again (what it left on
    its host killed, the host kept), once, and while `patient(150)` lasts."""
    deadline = time.monotonic() + patient(150)
    for attempt in range(1, START_ATTEMPTS + 1):
        running = [(h, start, start()) for h, start in starts]
        failed = []
        for host, start, proc in running:
            try:  # the log is appended to: an attempt that gave up never said it started
                wait_said(host.ray_log, STARTED, timeout=90, alive=proc)
            except ChildProcessError:
                failed.append((host, start, host.ray_log.read_text(errors="replace")[-3000:]))
        if not failed:
            return
        for host, _, said in failed:
            if starts_over(attempt, deadline):
                raise AssertionError(f"host {host.name}: Ray gave up {attempt} times:\n{said}")
            print(
                f"host {host.name}: ray start gave up, attempt {attempt}:\n{said}", file=sys.stderr
            )
            host.kill(keep_init=True)
        starts = [(h, s) for h, s, _ in failed]


@contextlib.contextmanager
def cluster(logs: Path, data_hosts: int = 2, trainer: bool = True, env: dict | None = None):
    """A head host (no CPUs for work: resource `control`), `data_hosts` data hosts (2 CPUs,
    resource `data`) and a trainer host (1 CPU, no `data`), each its own Ray node; yields the
    Hosts once every node is alive."""
    names = ["head", *(f"data{i}" for i in range(data_hosts)), *(["trainer"] if trainer else [])]
    hosts = Hosts(names, logs, env)
    try:
        head = hosts["head"]
        _ray_up([(head, lambda: head.start_ray(None, cpus=0, resources={"control": 1}))])
        starts = []  # the other nodes once the head is up: together, each started again alone
        for name in names[1:]:
            data = name.startswith("data")
            starts.append((hosts[name], functools.partial(
                hosts[name].start_ray, head, cpus=2 if data else 1,
                resources={"data": 4} if data else {"trainer": 1})))  # fmt: skip
        _ray_up(starts)
        hosts.wait_nodes(len(names), "head")
        yield hosts
    finally:
        hosts.close()


@contextlib.contextmanager
def autoscaling(logs: Path, data: dict, min_data: int, max_data: int, env: dict | None = None):
    """One host running a head (no CPUs for work: resource `control`) with Ray's own
    autoscaler over its fake multi-node provider: data nodes (`data`: their resources, CPU
    included) are started on this host when a request asks for them, `min_data` at once and at
    most `max_data`. The autoscaler (`ray start --autoscaling-config`, RAY_FAKE_CLUSTER) is
    Ray's own; only its "cloud" is processes of this host. On a host of its own, its ports and
    processes touch no other cluster here. Yields the Hosts once `min_data` nodes are up."""
    hosts = Hosts(["head"], logs, env)
    try:
        head = hosts["head"]
        config = logs / "autoscaling.json"
        config.write_text(json.dumps({
            "cluster_name": "tokenmill-test", "max_workers": max_data,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                         "disable_node_updaters": True, "disable_launch_config_check": True},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": 0, "control": 1}, "node_config": {},
                                     "max_workers": 0},
                "data": {"resources": {**data, "object_store_memory": 100 * MB}, "node_config": {},
                         "min_workers": min_data, "max_workers": max_data},
            },
            "head_node_type": "ray.head.default", "upscaling_speed": 1.0,
            "idle_timeout_minutes": 60, "auth": {}, "docker": {}, "file_mounts": {},
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [], "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        }))  # fmt: skip
        env = hosts.ray_env | {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        cmd = [RAY, "start", "--head", "--block", f"--autoscaling-config={config}",
               f"--port={GCS_PORT}", f"--node-ip-address={head.ip}", "--num-cpus=0",
               '--resources={"control": 1}', f"--object-store-memory={100 * MB}",
               f"--temp-dir={head.temp}", "--include-dashboard=false"]  # fmt: skip
        _ray_up([(head, lambda: head.run(cmd, head.ray_log, env=env))])
        hosts.wait_nodes(1 + min_data, "head")
        yield hosts
    finally:
        hosts.close()


def main() -> None:
    """`./dev hosts`: a head, two data hosts and a trainer host, up until Ctrl-C, with the
    demo corpus served in two lanes, one a data host."""
    import yaml

    from service.demo_corpus import build_demo_corpus

    logs = Path(tempfile.mkdtemp(prefix="tokenmill-hosts-"))
    corpus = build_demo_corpus()
    config = logs / "hosts.yaml"
    config.write_text(yaml.safe_dump({
        "seq_len": 512, "global_batch_size": 8, "lanes": 2,
        "streams": {"code": {"paths": [str(corpus / "code.jsonl")], "weight": 0.7},
                    "chat": {"kind": "chat", "paths": [str(corpus / "chat.jsonl")], "weight": 0.3}},
        "service": {"resources": {"data": 1}, "control_resources": {"control": 0.01}},
    }))  # fmt: skip
    with cluster(logs, trainer=True) as hosts:
        head, trainer = hosts["head"], hosts["trainer"]
        address = f"{head.ip}:{GCS_PORT}"
        on = {name: " ".join(h.enter()) for name, h in hosts.hosts.items()}
        token = f"env RAY_AUTH_TOKEN_PATH={hosts.token} PYTHONPATH={ROOT}"
        tm = Path(sys.executable).with_name("tokenmill")
        print(f"hosts up (logs in {logs}):")
        for h in hosts.hosts.values():
            print(f"  {h.name:8} {h.ip:15} namespace {h.ns}")
        print(f"""
Ray address {address}; the cluster's token: {hosts.token}
Serve on the head (its lanes go to the data hosts: service.resources {{"data": 1}}):
  {on["head"]} {token} {tm} serve --config {config} --address {address} --host {head.ip}
From the trainer host, with only the address (a trainer does the same: Feed.connect(address=...)):
  {on["trainer"]} {token} {tm} status --address {address}
  {on["trainer"]} curl -s http://{head.ip}:8000/v1/metrics
Lose a data host:  ip netns pids {hosts["data0"].ns} | xargs kill -9
Ctrl-C tears it all down.""", flush=True)  # fmt: skip
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        del trainer


if __name__ == "__main__":
    main()
