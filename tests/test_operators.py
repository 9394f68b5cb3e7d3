"""An operator's mistakes and an attacker's inputs meet a clear refusal (issue 53): a service
name that would leave the services folder, an API port another process holds, a config value
of the wrong type, a time that is not finite."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from client.records import claim, live_records, records_dir, release, service_file
from pipeline.config import ConfigError
from pipeline.read.resolve import parse_config
from service.serve import PortTaken, bind_api
from tests.conftest import fresh_cache, stdlib_texts, write_jsonl
from tests.rayhead import free_port, patient, wait_http
from wire.protocol import check_service_name

BAD_NAMES = ["../x", "../../tmp/evil", "a/b", "/abs", ".", "..", ".hidden", "", "x" * 65,
             "sp ace", "new\nline", "nul\0"]  # fmt: skip


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_outside_the_rule_is_refused_and_nothing_is_written(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="invalid service name"):
        check_service_name(name)
    with pytest.raises(ValueError, match="invalid service name"):
        service_file(name)
    with pytest.raises(ValueError, match="invalid service name"):
        claim(name)
    assert sorted(p.name for p in tmp_path.rglob("*")) == []  # nothing, anywhere


def test_good_names_and_the_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    for name in ("tokenmill", "run-7_b.2", "A" * 64):
        assert check_service_name(name) == name
    mine = claim("run-7_b.2")
    (records_dir() / "..evil.json").write_text("{}")  # a stray file is never read as a service
    try:
        assert service_file("run-7_b.2").parent == tmp_path / "cache" / "services"
        assert set(live_records()) == {"run-7_b.2"}
    finally:
        release(mine)
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    env = os.environ | {"TOKENMILL_CACHE": str(tmp_path / "cache")}
    for verb in ("status", "stop"):
        r = subprocess.run([sys.executable, "-m", "service", verb, "--name", f"../../{victim.stem}"],
                           env=env, capture_output=True, text=True, timeout=patient(60))  # fmt: skip
        assert r.returncode == 2 and "invalid service name" in r.stderr, r.stderr
    assert victim.exists()


def test_a_taken_api_port_is_refused_naming_who_holds_it(tmp_path, monkeypatch):
    """bind_api names the service recorded on that port; with none, "another process"."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(PortTaken, match=rf"127.0.0.1:{port} .*held by another process"):
            bind_api("127.0.0.1", port)
        mine = claim("holder")
        rec = json.loads(mine.read_text()) | {"api": f"http://127.0.0.1:{port}"}
        mine.write_text(json.dumps(rec))
        try:
            with pytest.raises(
                PortTaken, match=rf"held by service 'holder' \(serve pid {os.getpid()}\)"
            ):
                bind_api("127.0.0.1", port)
        finally:
            release(mine)
    finally:
        holder.close()
    free = bind_api("127.0.0.1", 0)  # port 0: any free one
    assert free.getsockname()[1] > 0
    free.close()


def _config(tmp_path) -> Path:
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(10, max_bytes=2000))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 2,
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}}))  # fmt: skip
    return cfg


def test_serve_on_a_taken_port_exits_at_once_and_records_nothing(tmp_path):
    """The finding: a second serve on a taken port ran on without an API, and its record named
    the other service's port, so `status --name b` pointed the operator at service a."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    env = os.environ | {"TOKENMILL_CACHE": str(tmp_path / "cache")}
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "service", "serve", "--config", str(_config(tmp_path)),
                            "--port", str(port), "--name", "b"], env=env, capture_output=True,
                           text=True, timeout=patient(120))  # fmt: skip
        assert r.returncode == 1, r.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
        assert time.monotonic() - t0 < 60  # before Ray, not after a service started
        assert not (tmp_path / "cache" / "services" / "b.json").exists()
    finally:
        holder.close()


@pytest.mark.slow
def test_serve_on_port_0_records_and_reports_the_port_it_bound(tmp_path):
    env = os.environ | {
        "TOKENMILL_CACHE": str(fresh_cache(tmp_path / "cache")),
        "TOKENMILL_API_TOKEN": "t",
    }
    for key in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS"):
        env.pop(key, None)
    name = f"zero{os.getpid()}"
    serve = subprocess.Popen([sys.executable, "-m", "service", "serve", "--config", str(_config(tmp_path)),
                              "--port", "0", "--name", name], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        record = tmp_path / "cache" / "services" / f"{name}.json"
        deadline = time.time() + patient(120)
        while "api" not in (json.loads(record.read_text()) if record.exists() else {}):
            assert time.time() < deadline and serve.poll() is None, "serve did not record its API"
            time.sleep(0.2)
        api = json.loads(record.read_text())["api"]
        port = int(api.rsplit(":", 1)[1])
        assert port > 0 and port != free_port()
        assert wait_http(f"{api}/healthz", timeout=60)
        st = subprocess.run([sys.executable, "-m", "service", "status", "--name", name, "--json"],
                            env=env, capture_output=True, text=True, timeout=patient(120))  # fmt: skip
        assert st.returncode == 0, st.stderr
        assert api in st.stdout
    finally:
        subprocess.run([sys.executable, "-m", "service", "stop", "--name", name], env=env,
                       capture_output=True, timeout=patient(120))  # fmt: skip
        try:
            serve.wait(timeout=patient(60))
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


BASE = {"streams": {"a": {"paths": ["/nonexistent/a.jsonl"]}}}


@pytest.mark.parametrize(
    "edit, says",
    [
        ({"lanes": True}, "lanes: must be int, got True"),
        ({"lanes": "2"}, "lanes: must be int, got '2'"),
        ({"seq_len": 1024.0}, "seq_len: must be int, got 1024.0"),
        ({"global_batch_size": False}, "global_batch_size: must be int"),
        ({"seed": "7"}, "seed: must be int"),
        ({"drop_last": 1}, "drop_last: must be bool, got 1"),
        ({"drop_last": "yes"}, "drop_last: must be bool"),
        ({"service": {"rank_timeout_s": float("inf")}}, "service.rank_timeout_s: must be a finite number or null, got inf"),
        ({"service": {"place_timeout_s": float("nan")}}, "service.place_timeout_s: must be a finite number or null"),
        ({"service": {"port": "8000"}}, "service.port: must be int"),
        ({"mixing": {"policy": {"every": 4, "wait_s": float("inf")}}}, "mixing.policy.wait_s: must be a finite number, got inf"),
        ({"mixing": {"policy": {"every": True}}}, "mixing.policy.every: must be int, got True"),
        ({"service": {"resources": {"data": True}}}, "service.resources: ['data'] must be a finite number, got True"),
    ],
)  # fmt: skip
def test_the_config_is_strict_about_types_and_finite_times(edit, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_config(BASE | edit)


def test_numbers_that_mean_what_they_say_still_load():
    from pipeline.config import Config

    cfg = Config.model_validate(BASE | {"lanes": 2, "service": {"rank_timeout_s": 30, "port": 0},
                               "mixing": {"policy": {"every": 4, "wait_s": 1.5}}})  # fmt: skip
    assert cfg.lanes == 2 and cfg.service.rank_timeout_s == 30.0 and cfg.service.port == 0
