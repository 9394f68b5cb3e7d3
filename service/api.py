"""The control plane (SPEC §3.3): FastAPI over the batch server.

Mutations need `Authorization: Bearer <token>`, the token coming from $TOKENMILL_API_TOKEN or
the file named by $TOKENMILL_API_TOKEN_FILE, never from the config or the logs. With no token
configured, mutations are refused. Every invalid input gets a 4xx that says what is wrong.

`PUT /v1/mixture` replaces the whole mixture: its `weights` must name every stream of the
config, each with a finite weight >= 0 (not all zero; 0 turns a stream off). A body that
leaves streams out is rejected with a 400 naming the missing ones rather than merged with the
current weights, so that a typo or a stale client cannot silently change the other streams'
shares; an unknown stream is a 400 too. The new weights take effect at the returned
`effective_step`, never retroactively.

`/docs` (Swagger UI) is served from assets bundled with the service (`swagger-ui-bundle`),
and `/` is a self-contained live page: both work without internet access.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt

from pipeline.mixing import check_weight
from pipeline.summary import stream_gauges

PAGE = Path(__file__).with_name("page.html")
SWAGGER_STATIC = "/static/swagger"  # where the bundled Swagger UI assets are mounted
DOCS_OPENAPI = "/docs/openapi.json"  # the schema as OpenAPI 3.0, for the bundled Swagger UI

PUT_MIXTURE_DOC = """Replace the mixture weights, from the returned `effective_step` on.

`weights` must name **every** stream of the config (see `GET /v1/status`), each with a finite
weight >= 0, not all zero; weights are normalized, and 0 turns a stream off. A subset is
rejected with a 400 that names the missing streams (it is not merged with the current
weights); an unknown stream is a 400 too. Needs `Authorization: Bearer <token>`."""


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

            from service.protocol import CONTROL_GROUP

            fn = fn.options(concurrency_group=CONTROL_GROUP)  # never queued behind rank polls
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


MAX_BODY = 64 << 10  # bytes; a mixture of a thousand streams fits many times over


def token_refusal(authorization: str | None) -> tuple[int, str] | None:
    """(status, message) when a mutation must be refused; None when the token is right."""
    token = api_token()
    if token is None:
        return 403, "mutations are disabled: set TOKENMILL_API_TOKEN on the server"
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return 401, "missing 'Authorization: Bearer <token>'"
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return 401, "wrong token"
    return None


class _TooLarge(Exception):
    pass


class GuardMutations:
    """ASGI middleware: a mutating request's token is checked before its body is read, and
    bodies are capped at MAX_BODY, so an unauthenticated client cannot make the server read,
    buffer or parse anything large."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = token_refusal(headers.get(b"authorization", b"").decode("latin-1"))
        if refusal:
            return await _reply(send, *refusal)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return await _reply(send, 413, f"request body over {MAX_BODY} bytes")
        received = 0

        async def capped():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY:
                raise _TooLarge
            return message

        try:
            await self.app(scope, capped, send)
        except _TooLarge:
            await _reply(send, 413, f"request body over {MAX_BODY} bytes")


async def _reply(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class MixtureUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: dict[str, StrictFloat | StrictInt]


def _unwrap(e: Exception) -> Exception:
    """Ray wraps actor exceptions; the cause is the one with the message."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e


def _swagger_assets() -> Path:
    from swagger_ui_bundle import swagger_ui_path

    return Path(swagger_ui_path)


def create_app(backend: Backend) -> FastAPI:
    # The default /docs and /redoc load their assets from a CDN; ours are served locally.
    app = FastAPI(
        title="tokenmill", version="0.1.0", description=__doc__, docs_url=None, redoc_url=None
    )
    app.mount(SWAGGER_STATIC, StaticFiles(directory=_swagger_assets()), name="swagger-static")
    app.add_middleware(GuardMutations)

    def require_token(authorization: str | None = Header(default=None)) -> None:
        refusal = token_refusal(authorization)
        if refusal:
            raise HTTPException(*refusal)

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

    @app.put(
        "/v1/mixture",
        dependencies=[Depends(require_token)],
        summary="Replace the mixture weights (all streams)",
        description=PUT_MIXTURE_DOC,
    )
    def put_mixture(update: MixtureUpdate) -> dict:
        for name, v in update.weights.items():
            try:
                check_weight(name, v)
            except ValueError as e:
                raise HTTPException(400, str(e)) from None
        streams = list(backend.call("status")["streams"])
        listed = ", ".join(repr(n) for n in streams)
        unknown = [n for n in update.weights if n not in streams]
        if unknown:
            names = ", ".join(repr(n) for n in unknown)
            raise HTTPException(
                400,
                f"unknown stream{'s' if len(unknown) > 1 else ''} {names}; streams are {listed}",
            )
        missing = [n for n in streams if n not in update.weights]
        if missing:
            names = ", ".join(repr(n) for n in missing)
            raise HTTPException(
                400,
                f"weights must name every stream; missing {names} (a PUT replaces the whole "
                f"mixture, it is not merged: give 0 to turn a stream off; streams are {listed})",
            )
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

    # The bundled Swagger UI (4.x) renders OpenAPI 3.0 only; FastAPI writes 3.1. /docs reads
    # the same schema written as 3.0 (only how null is spelled differs); /openapi.json stays 3.1.
    @app.get(DOCS_OPENAPI, include_in_schema=False)
    def docs_openapi() -> dict:
        return openapi_30(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=f"{root}{DOCS_OPENAPI}",
            title="tokenmill - API",
            swagger_js_url=f"{root}{SWAGGER_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{SWAGGER_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{SWAGGER_STATIC}/favicon-32x32.png",
        )

    return app


def openapi_30(schema: dict) -> dict:
    """`schema` (OpenAPI 3.1, as FastAPI writes it) as OpenAPI 3.0, for Swagger UI 4: JSON
    Schema's null type becomes `nullable`, a list of `examples` one `example`, `const` an enum."""
    maps = {"paths", "components", "schemas", "properties", "patternProperties", "$defs",
            "responses", "content", "headers", "examples", "securitySchemes", "callbacks"}  # fmt: skip

    def conv(x: Any) -> Any:
        if isinstance(x, list):
            return [conv(v) for v in x]
        if not isinstance(x, dict):
            return x
        out = {
            k: (
                {n: conv(v2) for n, v2 in v.items()}
                if k in maps and isinstance(v, dict)
                else conv(v)
            )
            for k, v in x.items()
        }
        for key in ("anyOf", "oneOf"):
            alts = out.get(key)
            if isinstance(alts, list) and {"type": "null"} in alts:
                rest = [a for a in alts if a != {"type": "null"}]
                del out[key]
                out["nullable"] = True
                if len(rest) == 1 and isinstance(rest[0], dict) and "$ref" not in rest[0]:
                    out = {**rest[0], **out}
                elif rest:
                    out[key] = rest
        t = out.get("type")
        if isinstance(t, list):
            types = [v for v in t if v != "null"]
            if len(types) < len(t):
                out["nullable"] = True
            del out["type"]
            if len(types) == 1:
                out["type"] = types[0]
            elif types:
                out["anyOf"] = [{"type": v} for v in types]
        if "const" in out:
            out["enum"] = [out.pop("const")]
        if isinstance(out.get("examples"), list):  # a schema's; an operation's are a map
            examples = out.pop("examples")
            if examples:
                out.setdefault("example", examples[0])
        return out

    converted = conv({k: v for k, v in schema.items() if k != "openapi"})
    return {"openapi": "3.0.3", **converted}


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
    for key, doc in stream_gauges():  # pipeline/summary.py declares them
        g = Gauge(f"tokenmill_stream_{key}", doc, ["stream"], registry=reg)
        for name, s in m["streams"].items():  # StreamSummary.as_dict()s
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
    per_rank = {
        "rank_lag_steps": ("lag", "Produced steps the rank is behind the producer"),
        "rank_data_wait_seconds_last_60s": (
            "wait_s_last_60s",
            "Data wait reported by the rank, last 60 s",
        ),
        "rank_lost": ("lost", "1 when the rank has stopped pulling (lost), else 0"),
    }
    ranks = m.get("ranks")
    ranks = ranks if isinstance(ranks, dict) else {}
    for metric, (key, doc) in per_rank.items():
        g = Gauge(f"tokenmill_{metric}", doc, ["rank"], registry=reg)
        for rank, r in ranks.items():
            v = _number(r.get(key) if isinstance(r, dict) else None)
            if v is not None:
                g.labels(rank=str(rank)).set(v)
    reg.register(_Rejects(_number(m.get("rejects", 0)) or 0.0))
    return generate_latest(reg).decode()


def _number(v: Any) -> float | None:
    """A metric value as a float (bools as 0/1); None for anything else."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    return None


class _Rejects:
    """`tokenmill_rejects_total`, a counter of the skipped (bad) records."""

    def __init__(self, value: float):
        self.value = value

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(
            "tokenmill_rejects", "Bad records skipped, all streams", value=self.value
        )
