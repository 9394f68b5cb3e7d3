"""The control API over a real batch server, through FastAPI's TestClient."""

import re
import time

import pytest
from fastapi.testclient import TestClient

from pipeline.read.resolve import parse_config
from service.api import Backend, create_app
from service.batch_server import BatchServer, StepGone
from tests.conftest import stdlib_texts, write_jsonl
from tests.helpers import resolved
from tests.rayhead import patient
from wire.arrays import from_ipc

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"


@pytest.fixture
def server(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(12, max_bytes=3000))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(12, start=20, max_bytes=3000))
    cfg = parse_config({"seq_len": 128, "global_batch_size": 4, "shuffle": {"window": 4},
                        "streams": {"web": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.6},
                                    "code": {"paths": [str(tmp_path / "b.jsonl")], "weight": 0.4}}})  # fmt: skip
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
    deadline = time.time() + patient(60)
    while srv.status()["global_step"] < 3 and time.time() < deadline:
        time.sleep(0.2)
    yield srv
    srv.close()  # stop the producer thread


@pytest.fixture
def client(server, monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_TOKEN", TOKEN)
    return TestClient(create_app(Backend(server)))


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def take(server, rank: int, world_size: int, step: int, timeout_s: float = 60.0):
    """`rank`'s runs of steps from `step` on (IPC streams; long-polling), or None when the data
    ended."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        reply = server.get(rank, world_size, step, 1.0)
        if reply.ready:
            return resolved(server, reply, rank, world_size).runs
        if reply.status in ("end", "stopped"):
            return None
    raise TimeoutError(f"step {step} was not served within {timeout_s}s")


def test_read_routes(client):
    assert client.get("/healthz").json() == {"ok": True}
    st = client.get("/v1/status").json()
    assert st["state"] in ("running", "paused") and st["streams"] == ["web", "code"]
    m = client.get("/v1/metrics").json()
    assert set(m["streams"]) == {"web", "code"} and 0 < m["packing_efficiency"] <= 1
    assert m["tokenizer_backend"]["fastokens"] > 0  # which tokenizer ran is reported
    text = client.get("/metrics").text
    assert (
        "tokenmill_tokens_per_second" in text
        and 'tokenmill_stream_realized_share{stream="web"}' in text
        and 'tokenmill_tokenizer_backend_tokens_total{backend="fastokens"}' in text
        and "tokenmill_rejects_total" in text
    )
    mix = client.get("/v1/mixture").json()
    assert mix["weights"] == pytest.approx({"web": 0.6, "code": 0.4})
    page = client.get("/").text
    assert "<canvas" in page and "http://" not in page and "https://" not in page  # air-gapped


def test_mutations_need_the_token(client, monkeypatch):
    body = {"weights": {"web": 1, "code": 1}}
    assert client.put("/v1/mixture", json=body).status_code == 401
    assert (
        client.put("/v1/mixture", json=body, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    assert client.put("/v1/mixture", json=body, headers={"Authorization": TOKEN}).status_code == 401
    assert client.post("/v1/pause").status_code == 401
    monkeypatch.delenv("TOKENMILL_API_TOKEN")
    r = client.put("/v1/mixture", json=body, headers=AUTH)
    assert r.status_code == 403 and "TOKENMILL_API_TOKEN" in r.json()["detail"]


def test_token_from_file(client, monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_API_TOKEN")
    (tmp_path / "tok").write_text("filetoken\n")
    monkeypatch.setenv("TOKENMILL_API_TOKEN_FILE", str(tmp_path / "tok"))
    r = client.post("/v1/pause", headers={"Authorization": "Bearer filetoken"})
    assert r.status_code == 200 and r.json() == {"state": "paused"}


def test_put_mixture_takes_effect_at_the_stated_step(client, server):
    r = client.put("/v1/mixture", json={"weights": {"web": 0, "code": 1}}, headers=AUTH)
    assert r.status_code == 200
    step = r.json()["effective_step"]
    assert step >= 3
    hist = client.get("/v1/mixture").json()["history"]
    assert hist[-1] == {"step": step, "weights": {"web": 0.0, "code": 1.0}, "source": "api"}
    # the steps from `step` on carry only the code stream (rank 0 of 1 takes every step up to
    # it: a step is held, and the producer runs ahead, only as far as the ranks allow)
    for s in range(server.status()["first_step"], step + 1):
        steps = take(server, 0, 1, s)
    batch = from_ipc(steps[0])  # one step was asked for: one run of one step
    assert set(s for row in batch.column("stream").to_pylist() for s in row) == {"code"}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"weights": {"nope": 1}}', "unknown stream 'nope'"),
        ('{"weights": {"web": 1, "code": 1, "nope": 1}}', "unknown stream 'nope'"),
        ('{"weights": {"web": 1}}', "missing 'code'"),
        ('{"weights": {"code": 0.5}}', "missing 'web'"),
        ('{"weights": {}}', "missing 'web', 'code'"),
        ('{"weights": {"web": -1}}', "finite and >= 0"),
        ('{"weights": {"web": 0, "code": 0}}', "not all be zero"),
        ('{"weights": {"web": NaN}}', "finite"),
        ('{"weights": {"web": Infinity}}', "finite"),
        ('{"weights": {"web": "0.5"}}', "weights.web"),
        ('{"weights": {"web": true}}', "weights.web"),
        ('{"weights": [1, 2]}', "weights"),
        ('{"weight": {"web": 1}}', "weights"),
        ("{not json", "JSON"),
        ("", "body"),
    ],
)
def test_invalid_mixture_is_a_4xx_with_a_message(client, content, fragment):
    r = client.put(
        "/v1/mixture", content=content, headers=AUTH | {"Content-Type": "application/json"}
    )
    assert 400 <= r.status_code < 500, r.text
    assert fragment.lower() in r.text.lower()


def test_state_route(client):
    s = client.get("/v1/state", params={"step": 1}).json()
    assert s["step"] == 1 and s["version"] == 3 and len(s["digest"]) == 64
    assert client.get("/v1/state", params={"step": 10**9}).status_code == 404
    assert client.get("/v1/state", params={"step": -1}).status_code == 422
    assert client.get("/v1/state", params={"step": "abc"}).status_code == 422


def test_pause_and_resume(client, server):
    assert client.post("/v1/pause", headers=AUTH).json() == {"state": "paused"}
    time.sleep(1.5)
    assert client.get("/v1/status").json()["state"] == "paused"
    assert client.post("/v1/resume", headers=AUTH).json() == {"state": "running"}


def test_far_behind_rank_gets_a_clear_error(server):
    # consume far ahead with rank 0 so that early steps are evicted
    for s in range(0, 12):
        if take(server, 0, 1, s) is None:
            break
    with pytest.raises(StepGone, match="no longer held"):
        server.get(0, 1, 0)


def test_a_subset_of_streams_is_rejected_not_merged(client):
    before = client.get("/v1/mixture").json()
    r = client.put("/v1/mixture", json={"weights": {"code": 1}}, headers=AUTH)
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert "missing 'web'" in detail and "'code'" not in detail.split("missing")[1].split("(")[0]
    assert "not merged" in detail
    assert client.get("/v1/mixture").json()["history"] == before["history"]  # nothing changed
    # the decision is documented where clients read it
    op = client.get("/openapi.json").json()["paths"]["/v1/mixture"]["put"]
    assert "every" in op["description"] and "missing" in op["description"]


class FakeBackend:
    """Just enough of the batch server for the routes that do not need a real one."""

    def __init__(self, metrics: dict | None = None):
        self._metrics = metrics or {}

    def status(self):
        return {"state": "running", "streams": ["web", "code"], "world_size": 2, "global_step": 9}

    def metrics(self):
        return self._metrics


def fake_metrics(**extra) -> dict:
    share = {"target_share": 0.5, "realized_share": 0.5, "tokens": 1, "docs": 1, "skipped": 0,
             "split": 0, "truncated": 0, "dropped": 0}  # fmt: skip
    return {"tokens_per_s": 1.0, "batches_per_s": 1.0, "global_step": 9, "packing_efficiency": 0.9,
            "data_wait_s_last_60s": 0.5, "streams": {"web": share, "code": share},
            "queue_depth": {"0": 1, "1": 7}, **extra}  # fmt: skip


def test_docs_work_offline():
    client = TestClient(create_app(Backend(FakeBackend())))
    r = client.get("/docs")
    assert r.status_code == 200 and "swagger-ui" in r.text
    assert "http://" not in r.text and "https://" not in r.text, (
        "no CDN: /docs must work air-gapped"
    )
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
    for url in assets:
        a = client.get(url)
        assert a.status_code == 200 and a.content, url
    spec_url = re.search(r"url: '([^']+)'", r.text).group(1)
    spec = client.get(spec_url).json()
    assert spec["openapi"].startswith("3.0.")  # what the bundled Swagger UI renders
    assert set(spec["paths"]) == set(client.get("/openapi.json").json()["paths"])
    assert "anyOf" not in str(spec["paths"]["/v1/state"])  # nullable, not a null type
    assert client.get("/redoc").status_code == 404  # its assets would come from a CDN


def test_prometheus_per_rank_gauges_and_rejects():
    ranks = {
        "0": {"next_step": 8, "lag": 1, "wait_s_last_60s": 0.25, "waits": 3, "lost": False,
              "seen_s_ago": 0.1, "connected": True},
        "1": {"next_step": 2, "lag": 7, "wait_s_last_60s": 0.0, "waits": 0, "lost": True,
              "seen_s_ago": 700.0, "connected": False},
    }  # fmt: skip
    m = fake_metrics(ranks=ranks, rejects=5, world_size=2)
    text = TestClient(create_app(Backend(FakeBackend(m)))).get("/metrics").text
    for line in (
        'tokenmill_rank_lag_steps{rank="0"} 1.0',
        'tokenmill_rank_lag_steps{rank="1"} 7.0',
        'tokenmill_rank_data_wait_seconds_last_60s{rank="0"} 0.25',
        'tokenmill_rank_lost{rank="0"} 0.0',
        'tokenmill_rank_lost{rank="1"} 1.0',
        "tokenmill_rejects_total 5.0",
    ):
        assert line in text.splitlines(), line


@pytest.mark.parametrize(
    "extra",
    [
        {},  # a server from before per-rank metrics
        {"ranks": None, "rejects": None},
        {"ranks": {"0": None, "1": {"lag": None, "lost": "yes"}, "2": {}}},
        {"ranks": [1, 2]},
    ],
)
def test_prometheus_tolerates_missing_or_odd_rank_metrics(extra):
    r = TestClient(create_app(Backend(FakeBackend(fake_metrics(**extra))))).get("/metrics")
    assert r.status_code == 200
    assert "tokenmill_rejects_total 0.0" in r.text and "# TYPE tokenmill_rank_lost gauge" in r.text


def test_a_stall_shows_while_it_happens_and_what_the_trainers_take(server, client):
    """Production paused, a rank asks past the steps made: status, metrics and Prometheus name
    the stall and how long the rank has waited *while* it waits (the trainer's own report
    comes only after); the figure of what trainers take follows their beats."""
    from service import server_view as server_module

    held = server.status()["global_step"]
    assert client.post("/v1/pause", headers=AUTH).status_code == 200
    for step in range(held):
        assert server.get(0, 1, step, 5.0).ready
    for r in range(3):  # beats: consumed steps 0, 1, 2 at three times
        server.beat(0, 1, r)
        time.sleep(0.2)
    assert server.metrics()["consumed_tokens_per_s"] > 0
    t0 = time.time()
    while time.time() - t0 < server_module.STALL_S + 1:
        assert not server.get(0, 1, held, 0.5).ready  # paused: nothing comes
    st = client.get("/v1/status").json()
    assert st["stall"].startswith("ranks [0] waiting") and st["stall"].endswith(": paused")
    assert st["ranks_waiting_s"]["0"] >= server_module.STALL_S
    m = client.get("/v1/metrics").json()
    assert m["ranks"]["0"]["waiting_s"] >= server_module.STALL_S and m["stall"] == st["stall"]
    prom = client.get("/metrics").text
    assert re.search(r'tokenmill_rank_waiting_seconds\{rank="0"\} [0-9.]+', prom)
    assert "tokenmill_stalled 1.0" in prom and "tokenmill_consumed_tokens_per_second" in prom
    assert client.post("/v1/resume", headers=AUTH).status_code == 200
    deadline = time.time() + patient(60)
    while not server.get(0, 1, held, 1.0).ready:
        assert time.time() < deadline
    st = client.get("/v1/status").json()
    assert st["stall"] is None and st["ranks_waiting_s"] == {}
