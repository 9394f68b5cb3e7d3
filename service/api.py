"""The control plane (SPEC §3.3): FastAPI over the batch server.

Mutations need `Authorization: Bearer <token>`, the token coming from $TOKENMILL_API_TOKEN or
the file named by $TOKENMILL_API_TOKEN_FILE, never from the config or the logs. With no token
configured, mutations are refused. Every invalid input gets a 4xx that says what is wrong.
"""

from __future__ import annotations

import hmac
import math
import os
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt

PAGE = Path(__file__).with_name("page.html")


class Backend:
    """Calls into the batch server: a Ray actor handle, or a local object in tests."""

    def __init__(self, target, timeout_s: float = 10.0):
        self.target = target
        self.timeout_s = timeout_s
        self._remote = hasattr(getattr(target, "status", None), "remote")

    def call(self, method: str, *args):
        fn = getattr(self.target, method)
        if self._remote:
            import ray

            return ray.get(fn.remote(*args), timeout=self.timeout_s)
        return fn(*args)


def api_token() -> str | None:
    token = os.environ.get("TOKENMILL_API_TOKEN")
    path = os.environ.get("TOKENMILL_API_TOKEN_FILE")
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError:
            token = None
    return token or None


class MixtureUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: dict[str, StrictFloat | StrictInt]


def _unwrap(e: Exception) -> Exception:
    """Ray wraps actor exceptions; the cause is the one with the message."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e


def create_app(backend: Backend) -> FastAPI:
    app = FastAPI(title="tokenmill", version="0.1.0", description=__doc__)

    def require_token(authorization: str | None = Header(default=None)) -> None:
        token = api_token()
        if token is None:
            raise HTTPException(
                403, "mutations are disabled: set TOKENMILL_API_TOKEN on the server"
            )
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(401, "missing 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(401, "wrong token")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msgs = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            msgs.append(f"{loc or 'body'}: {err.get('msg')}")
        return JSONResponse(status_code=422, content={"detail": "; ".join(msgs)})

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/status")
    def status() -> dict:
        return backend.call("status")

    @app.get("/v1/metrics")
    def metrics() -> dict:
        return backend.call("metrics")

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> str:
        return prometheus_text(backend.call("metrics"), backend.call("status"))

    @app.get("/v1/mixture")
    def get_mixture() -> dict:
        return backend.call("mixture")

    @app.put("/v1/mixture", dependencies=[Depends(require_token)])
    def put_mixture(update: MixtureUpdate) -> dict:
        for name, v in update.weights.items():
            if not math.isfinite(v) or v < 0:
                raise HTTPException(400, f"weight of {name!r} must be finite and >= 0, got {v}")
        try:
            step = backend.call("set_weights", dict(update.weights))
        except Exception as e:
            e = _unwrap(e)
            if isinstance(e, ValueError):
                raise HTTPException(400, str(e)) from None
            raise
        return {"effective_step": step}

    @app.post("/v1/pause", dependencies=[Depends(require_token)])
    def pause() -> dict:
        return {"state": backend.call("pause")}

    @app.post("/v1/resume", dependencies=[Depends(require_token)])
    def resume() -> dict:
        return {"state": backend.call("resume")}

    @app.get("/v1/state")
    def state(step: int | None = Query(default=None, ge=0, le=2**62)) -> Any:
        try:
            return backend.call("state", step)
        except Exception as e:
            e = _unwrap(e)
            if isinstance(e, LookupError):
                raise HTTPException(404, str(e)) from None
            raise

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text()

    return app


def prometheus_text(m: dict, st: dict) -> str:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()

    def gauge(name, doc, value, labels=None):
        g = Gauge(f"tokenmill_{name}", doc, list(labels or {}), registry=reg)
        (g.labels(**labels) if labels else g).set(value)
        return g

    gauge("tokens_per_second", "Packed real tokens per second (30 s window)", m["tokens_per_s"])
    gauge("batches_per_second", "Global steps per second (30 s window)", m["batches_per_s"])
    gauge("global_step", "Global steps produced", m["global_step"])
    gauge("packing_efficiency", "Real tokens / (rows x seq_len)", m["packing_efficiency"])
    gauge(
        "data_wait_seconds_last_60s",
        "Data wait reported by trainers, last 60 s",
        m["data_wait_s_last_60s"],
    )
    gauge("up", "1 while running", 1.0 if st["state"] in ("running", "paused") else 0.0)
    per_stream = {
        "stream_tokens": ("tokens", "Tokens served"),
        "stream_docs": ("docs", "Documents started"),
        "stream_skipped": ("skipped", "Bad records skipped"),
        "stream_split": ("split", "Overlong documents split"),
        "stream_truncated": ("truncated", "Overlong documents truncated"),
        "stream_dropped": ("dropped", "Overlong documents dropped"),
        "stream_target_share": ("target_share", "Target token share"),
        "stream_realized_share": ("realized_share", "Realized token share"),
    }
    for metric, (key, doc) in per_stream.items():
        g = Gauge(f"tokenmill_{metric}", doc, ["stream"], registry=reg)
        for name, s in m["streams"].items():
            g.labels(stream=name).set(s[key])
    b = Gauge(
        "tokenmill_tokenizer_backend_tokens",
        "Tokens read, by the tokenizer backend that encoded them",
        ["backend"],
        registry=reg,
    )
    for backend, n in m.get("tokenizer_backend", {}).items():
        b.labels(backend=backend).set(n)
    q = Gauge(
        "tokenmill_rank_queue_depth", "Produced steps a rank has not taken", ["rank"], registry=reg
    )
    for rank, depth in m["queue_depth"].items():
        q.labels(rank=rank).set(depth)
    return generate_latest(reg).decode()
