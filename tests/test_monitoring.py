"""What the service reports about itself, without Ray: `/metrics` (Prometheus types and names),
`/v1/metrics`' clock, the OpenAPI schema behind `/docs` (the bearer scheme that lets "Try it
out" send the token), and `/v1/state`'s word on authentication. The batch server is a fake that
answers with the fields the real one reports (service/batch_server.py)."""

import re
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.api import PAGE, STATE_AUTH_HEADER, Backend, create_app, prometheus_text
from service.telemetry import Telemetry

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHARE = {"target_share": 0.5, "realized_share": 0.25, "tokens": 700, "docs": 9, "docs_read": 9,
         "tokens_read": 800, "skipped": 2, "split": 1, "truncated": 0, "dropped": 3}  # fmt: skip
# A healthy slow rank: it trains at step 7, has fetched to 32, the window is full.
RANKS = {
    "0": {"consumed_step": 7, "fetched_step": 32, "next_step": 32, "buffered": 25, "lag": 57,
          "last_sign_s_ago": 1.5, "seen_s_ago": 1.5, "ended": False, "lost": False,
          "connected": True, "wait_s_last_60s": 0.0, "waits": 0},
    "1": {"consumed_step": None, "fetched_step": 3, "buffered": 0, "lag": 61,
          "last_sign_s_ago": 700.0, "ended": False, "lost": True, "connected": True},
}  # fmt: skip


def metrics(**extra) -> dict:
    return {"tokens_per_s": 0.0, "batches_per_s": 0.0, "producer": "window_full", "global_step": 64,
            "held_steps": 32, "prefetch": 32, "lag_normal_max": 64, "real_tokens": 12345,
            "rows": 256, "packing_efficiency": 0.9, "data_wait_s_last_60s": 0.0,
            "streams": {"web": SHARE, "code": SHARE}, "tokenizer_backend": {"fastokens": 1600},
            "world_size": 2, "ranks": RANKS, "queue_depth": {"0": 57, "1": 61}, "rejects": 5,
            "history": [], "mixture_history": [], **extra}  # fmt: skip


class FakeServer:
    def __init__(self, m: dict | None = None):
        self.m = metrics() if m is None else m
        self.paused = False

    def status(self):
        return {"state": "running", "producer": self.m.get("producer"), "global_step": 64,
                "streams": ["web", "code"], "world_size": 2,
                "autoscale": self.m.get("autoscale")}  # fmt: skip

    def metrics(self):
        return dict(self.m)

    def state(self, step, wait_s=None):
        if step not in (None, 3):
            raise LookupError(f"no state for step {step}")
        return {"version": 3, "step": 3, "digest": "0" * 64}

    def pause(self):
        self.paused = True
        return "paused"

    def resume(self):
        self.paused = False
        return "running"


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_TOKEN", TOKEN)
    return TestClient(create_app(Backend(FakeServer())))


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_running_totals_are_counters_and_levels_stay_gauges():
    text = prometheus_text(metrics(), {"state": "running"})
    fams = families(text)  # parses as Prometheus text
    counters = {"tokenmill_stream_tokens", "tokenmill_stream_docs", "tokenmill_stream_skipped",
                "tokenmill_stream_split", "tokenmill_stream_truncated", "tokenmill_stream_dropped",
                "tokenmill_tokenizer_backend_tokens", "tokenmill_rejects", "tokenmill_tokens",
                "tokenmill_rows"}  # fmt: skip
    for name in counters:
        assert fams[name].type == "counter", name
        assert f"# TYPE {name}_total counter" in text, name  # `_total`, as the convention wants
    gauges = {"tokenmill_tokens_per_second", "tokenmill_global_step",
              "tokenmill_stream_target_share", "tokenmill_stream_realized_share",
              "tokenmill_rank_lag_steps", "tokenmill_packing_efficiency"}  # fmt: skip
    for name in gauges:
        assert fams[name].type == "gauge", name
    lines = text.splitlines()
    for line in ('tokenmill_stream_tokens_total{stream="web"} 700.0',
                 'tokenmill_stream_skipped_total{stream="code"} 2.0',
                 'tokenmill_tokenizer_backend_tokens_total{backend="fastokens"} 1600.0',
                 "tokenmill_rejects_total 5.0", "tokenmill_tokens_total 12345.0",
                 'tokenmill_stream_realized_share{stream="web"} 0.25'):  # fmt: skip
        assert line in lines, line
    # no running total is left typed as a gauge
    assert not re.search(r"# TYPE tokenmill_stream_(tokens|docs|skipped) gauge", text)


def test_producer_state_and_where_each_rank_is():
    lines = prometheus_text(metrics(), {"state": "running"}).splitlines()
    assert 'tokenmill_producer_state{state="window_full"} 1.0' in lines
    assert 'tokenmill_producer_state{state="making"} 0.0' in lines
    assert "tokenmill_lag_normal_max_steps 64.0" in lines
    for line in ('tokenmill_rank_consumed_step{rank="0"} 7.0',
                 'tokenmill_rank_fetched_step{rank="0"} 32.0',
                 'tokenmill_rank_buffered_steps{rank="0"} 25.0',
                 'tokenmill_rank_last_sign_of_life_seconds{rank="0"} 1.5',
                 'tokenmill_rank_lost{rank="0"} 0.0', 'tokenmill_rank_lost{rank="1"} 1.0',
                 'tokenmill_rank_ended{rank="0"} 0.0'):  # fmt: skip
        assert line in lines, line
    # a rank whose client does not report its consumed step has no such sample, not a 0
    assert not any(line.startswith('tokenmill_rank_consumed_step{rank="1"}') for line in lines)


def test_metrics_from_an_older_server_still_render():
    old = metrics(ranks={"0": {"next_step": 8, "lag": 1, "seen_s_ago": 0.1, "lost": False}})
    for key in ("producer", "lag_normal_max", "real_tokens", "rows", "tokenizer_backend"):
        del old[key]
    lines = prometheus_text(old, {"state": "running"}).splitlines()
    assert 'tokenmill_rank_fetched_step{rank="0"} 8.0' in lines  # its older name, next_step
    assert 'tokenmill_rank_last_sign_of_life_seconds{rank="0"} 0.1' in lines
    assert not any(line.startswith("tokenmill_producer_state{") for line in lines)


def test_v1_metrics_carries_the_clock_the_page_plots_against(client):
    m = client.get("/v1/metrics").json()
    assert abs(m["server_time"] - time.time()) < 5 and m["producer"] == "window_full"


def test_mutations_declare_the_bearer_scheme_that_docs_sends():
    client = TestClient(create_app(Backend(FakeServer())))
    for url in ("/openapi.json", "/docs/openapi.json"):  # FastAPI's and the one /docs reads
        spec = client.get(url).json()
        assert spec["components"]["securitySchemes"]["bearer"] == {
            "type": "http",
            "scheme": "bearer",
            "description": spec["components"]["securitySchemes"]["bearer"]["description"],
        }
        paths = spec["paths"]
        for path, method in (("/v1/mixture", "put"), ("/v1/pause", "post"), ("/v1/resume", "post")):
            assert paths[path][method]["security"] == [{"bearer": []}], (url, path)
            params = paths[path][method].get("parameters", [])
            assert not any(p["name"].lower() == "authorization" for p in params)
        for path, ops in paths.items():
            if "get" in ops and path != "/v1/steps/{step}/provenance":  # that one reveals data
                assert "security" not in ops["get"], path  # reads are open
        assert paths["/v1/steps/{step}/provenance"]["get"]["security"] == [{"bearer": []}]


def test_the_bearer_token_as_docs_sends_it(client):
    assert client.post("/v1/pause").status_code == 401
    assert client.post("/v1/pause", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = client.post("/v1/pause", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"state": "paused"}


def test_state_says_it_is_not_authenticated_and_why(client):
    r = client.get("/v1/state", params={"step": 3})
    assert r.status_code == 200 and r.json()["step"] == 3
    why = r.headers[STATE_AUTH_HEADER]
    assert why.startswith("none") and "read-only" in why and "secret" in why
    gone = client.get("/v1/state", params={"step": 9})
    assert gone.status_code == 404 and gone.headers[STATE_AUTH_HEADER] == why
    op = client.get("/openapi.json").json()["paths"]["/v1/state"]["get"]
    assert "not authenticated" in op["summary"].lower()
    assert "not authenticated" in op["description"].lower() and why in op["description"]
    assert STATE_AUTH_HEADER in op["responses"]["200"]["headers"]
    assert "security" not in op


def test_no_spec_section_references_in_what_users_read(client):
    spec = client.get("/openapi.json").text
    assert "SPEC" not in spec and "§" not in spec
    page = PAGE.read_text()
    assert "SPEC" not in page and "§" not in page


def test_telemetry_observes_the_producer_and_lags_once_a_second_and_on_each_change():
    now = [100.0]
    t = Telemetry(clock=lambda: now[0])
    for state, dt in [("making", 0.4), ("making", 0.7), ("making", 0.2), ("window_full", 0.1),
                      ("window_full", 1.0), ("paused", 0.0)]:  # fmt: skip
        t.observe(state, {0: 3, 1: None})
        now[0] += dt
    view = t.observations_view()
    assert [(round(o["t"], 6), o["producer"]) for o in view] == [
        (100.0, "making"), (101.1, "making"), (101.3, "window_full"), (102.4, "paused")
    ]  # fmt: skip
    assert view[0]["lag"] == {"0": 3, "1": None}


def test_telemetry_is_safe_from_any_thread():
    """Wait reports arrive outside the batch server's lock while metrics read them: a reader
    must never see a deque change under it ("deque mutated during iteration")."""
    t = Telemetry()
    stop, errors = threading.Event(), []

    def report():
        while not stop.is_set():
            t.report_wait(1, 0.1)
            t.observe("making", {1: 2})

    writers = [threading.Thread(target=report) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        deadline = time.time() + 2
        while time.time() < deadline:
            try:
                t.wait_by_rank()
                t.observations_view()
            except RuntimeError as e:
                errors.append(e)
                break
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert not errors, errors
