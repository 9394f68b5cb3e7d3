"""The plane across hosts (tests/hosts.py: each host a network namespace with its own address
and PID namespace, its own Ray node): `serve` on the head host, its lanes on two data hosts,
two trainer ranks on a trainer host that know only the Ray address. The ranks pull their rows
straight from the lanes (no row byte passes through the control process), a data host is lost
mid-run, and every rank still gets every step once, byte for byte the export's. The API is
reached across the network with its token, and `tokenmill status` works from the trainer host
with no record of the service there."""

import json
import sys
import time
from pathlib import Path

import pytest

from tests import hosts as hostlib
from tests.conftest import fresh_cache
from tests.rayhead import patient
from tests.test_nodes import RANKS, STEPS, assert_rows_are_the_export, lost_node_config

pytestmark = pytest.mark.slow
API_PORT = 8000  # the head host's own port: no other process there
API_TOKEN = "t" * 40

# On the trainer host: the API across the network, with and without its token; prints what
# it saw. Waits until both lanes say where they run.
PROBE = r"""
import json, sys, time, urllib.request, urllib.error
base, token, want, wait = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def get(path, data=None, auth=None):
    req = urllib.request.Request(base + path, data=data, method="POST" if data is not None else "GET")
    if auth:
        req.add_header("Authorization", "Bearer " + auth)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
deadline = time.time() + wait
while True:
    try:
        code, m = get("/v1/metrics")
        lanes = m.get("lanes") or []
        if len(lanes) == 2 and all(l.get("node_ip") for l in lanes):
            break
    except OSError:
        pass
    assert time.time() < deadline, "the service did not answer across the network with its lanes placed"
    time.sleep(0.5)
out = {"lanes": lanes}
if want == "mutate":
    out["no_token"] = get("/v1/pause", b"")[0]
    out["pause"] = get("/v1/pause", b"", token)[0]
    out["resume"] = get("/v1/resume", b"", token)[0]
print(json.dumps(out))
"""


def _probe(hosts, want: str = "") -> dict:
    base = f"http://{hosts['head'].ip}:{API_PORT}"
    wait = patient(180)
    r = hosts.python("trainer", PROBE, base, API_TOKEN, want, str(wait), timeout=wait + 60)
    assert r.returncode == 0, r.stderr[-3000:] + hosts.tails()
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_ranks_on_a_trainer_host_pull_from_lanes_on_data_hosts_and_survive_a_lost_host(tmp_path):
    why = hostlib.available()
    if why:
        pytest.skip(why)
    want = lost_node_config(tmp_path, 2)
    logs = tmp_path / "logs"
    logs.mkdir()
    with hostlib.cluster(logs) as hosts:
        head, trainer = hosts["head"], hosts["trainer"]
        address = f"{head.ip}:{hostlib.GCS_PORT}"
        # The service's records and cache on the head; the trainer host has none of them.
        serve_env = hosts.env | {"TOKENMILL_CACHE": str(fresh_cache(tmp_path / "head-cache")),
                                 "TOKENMILL_API_TOKEN": API_TOKEN}  # fmt: skip
        trainer_env = hosts.env | {"TOKENMILL_CACHE": str(tmp_path / "trainer-cache")}
        head.run([sys.executable, "-m", "service", "serve", "--config", str(tmp_path / "c.yaml"),
                  "--address", address, "--host", head.ip, "--port", str(API_PORT),
                  "--name", "multi"], logs / "serve.log", env=serve_env, cwd=tmp_path)  # fmt: skip
        seen = _probe(hosts, "mutate")
        data_ips = {hosts["data0"].ip, hosts["data1"].ip}
        placed = [lane["node_ip"] for lane in seen["lanes"]]
        assert set(placed) == data_ips, (placed, data_ips)  # spread, one lane a data host
        assert (seen["no_token"], seen["pause"], seen["resume"]) == (401, 200, 200), seen

        status = hosts.python("trainer", STATUS, address, env=trainer_env, timeout=patient(120))
        assert status.returncode == 0, status.stderr[-3000:]
        assert "service   multi" in status.stdout, status.stdout
        assert not (tmp_path / "trainer-cache").exists() or not any(
            (tmp_path / "trainer-cache").rglob("*.json")
        )  # it found the service through Ray, not through a record

        out = tmp_path / "rows.npz"
        ranks = trainer.run([sys.executable, "-c", RANKS, address, "multi", str(STEPS), str(out),
                             "0.02"], logs / "ranks.log", env=trainer_env, cwd=tmp_path)  # fmt: skip
        deadline = time.time() + patient(180)
        while not all(Path(f"{out}.at10.{r}").exists() for r in range(2)):  # 10 steps in
            assert time.time() < deadline and ranks.poll() is None, hosts.tails(4000)
            time.sleep(0.1)
        lost = next(h for h in hosts.hosts.values() if h.ip == placed[0])
        lost.kill()  # every process of the host: its raylet, object store, lane
        Path(f"{out}.go").touch()
        ranks.wait(timeout=patient(300))
        assert ranks.returncode == 0, hosts.tails(4000)
        after = json.loads(hosts.python("trainer", METRICS, f"http://{head.ip}:{API_PORT}").stdout)
    assert {r["lane"] for r in after["lanes_restarted"]} == {0}, after["lanes_restarted"]
    survivor = (data_ips - {placed[0]}).pop()
    assert [lane["node_ip"] for lane in after["lanes"]] == [survivor, survivor], after["lanes"]
    assert after["control_row_bytes"] == 0  # the rows went from the lanes to the ranks
    assert_rows_are_the_export(out, want, 2)


# `tokenmill status` on the trainer host, with only the address (no record there).
STATUS = r"""
import sys
from service.cli import main
sys.exit(main(["status", "--name", "multi", "--address", sys.argv[1]]))
"""

METRICS = r"""
import json, sys, urllib.request
m = json.loads(urllib.request.urlopen(sys.argv[1] + "/v1/metrics", timeout=10).read())
print(json.dumps({k: m[k] for k in ("lanes", "lanes_restarted", "control_row_bytes")}))
"""
