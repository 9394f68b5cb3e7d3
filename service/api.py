"""The control plane: an HTTP API over the batch server.

Reads (`GET`) are open; mutations (`PUT /v1/mixture`, `POST /v1/pause`, `POST /v1/resume`)
need `Authorization: Bearer <token>` (in `/docs`: **Authorize**, then "Try it out"). The
service takes the token from $TOKENMILL_API_TOKEN or the file named by
$TOKENMILL_API_TOKEN_FILE, never from the config or the logs; with no token set, mutations
are refused. Every invalid input gets a 4xx that says what is wrong.

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
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as Path_
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from pipeline.config import check_weight
from service.prometheus import prometheus_text

PAGE = Path(__file__).with_name("page.html")
SWAGGER_STATIC = "/static/swagger"  # where the bundled Swagger UI assets are mounted
DOCS_OPENAPI = "/docs/openapi.json"  # the schema as OpenAPI 3.0, for the bundled Swagger UI

PUT_MIXTURE_DOC = """Replace the mixture weights, from the returned `effective_step` on.

`weights` must name **every** stream of the config (see `GET /v1/status`), each with a finite
weight >= 0, not all zero; weights are normalized, and 0 turns a stream off. A subset is
rejected with a 400 that names the missing streams (it is not merged with the current
weights); an unknown stream is a 400 too. Needs `Authorization: Bearer <token>`."""

STATE_AUTH_HEADER = "X-Tokenmill-Auth"
STATE_AUTH = (
    "none: read-only, like every GET here. A state holds read positions, counters and mixture "
    "weights, never tokens, text or secrets; only a rank inside the Ray cluster can resume "
    "from one, not a client of this API; mutations need the token"
)
SKIPS_DOC = """Leave documents out of the running sequence from the first step not made yet
(`effective_step` in the answer): the documents the `steps` named drew (steps made already;
recomputed from a kept state if no longer held), and the `docs` named. What follows is what
`tokenmill serve --resume STATE --skip-steps ...` would make from that step's state: those
documents are dropped where they leave the shuffle, in every epoch; every other document comes
in the order it would have; the mixture stays exact. Steps made before are kept, and
connected ranks go on without a restart. Audited: the state's skip log (step, count, `why`)
and `/v1/metrics` `left_out`, so every later state and resume leaves them out too. Needs
`Authorization: Bearer <token>`."""

# How long GET /v1/state waits for the mixing policy's loss that a state carries (a step the
# ranks have not trained yet: 503 with Retry-After after that).
STATE_WAIT_S = 5.0
STATE_DOC = f"""The resume state after global step `step` (default: the newest held): small JSON that
a trainer saves beside its checkpoint and hands back on resume (`Feed.connect(..., state=...)`,
`tokenmill export --resume`). A step no longer held is a 404. Under `mixing.policy` the state
carries the loss its resume decides from: for a step the ranks have not trained yet, that
loss is not in, and the answer is a 503 with `Retry-After` (ask for a trained step).

**Not authenticated**, on purpose; every answer says so in its `{STATE_AUTH_HEADER}` header.
Why: {STATE_AUTH}."""


class Backend:
    """Calls into the batch server: a Ray actor handle, or a local object in tests."""

    def __init__(self, target, timeout_s: float = 10.0):
        self.target = target
        self.timeout_s = timeout_s
        self._remote = hasattr(getattr(target, "status", None), "remote")

    def call(self, method: str, *args, timeout_s: float | None = None):
        fn = getattr(self.target, method)
        if self._remote:
            import ray

            from wire.protocol import CONTROL_GROUP

            fn = fn.options(concurrency_group=CONTROL_GROUP)  # never queued behind rank polls
            return ray.get(fn.remote(*args), timeout=timeout_s or self.timeout_s)
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


# The mutating routes declare an HTTP bearer scheme, so that /docs offers "Authorize" and its
# "Try it out" sends the token (Swagger UI never sends an `Authorization` header parameter).
# GuardMutations has checked the token before; `require_token` checks it the same way.
BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="The service's API token ($TOKENMILL_API_TOKEN); mutations need it.",
)
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]


class MixtureUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: dict[str, StrictFloat | StrictInt]


class SkipRequest(BaseModel):
    """POST /v1/skips: steps made already (`"41230-41240"`, `"3,7,9-11"`) and/or documents
    ({stream, doc_id} or {stream, source, record}, as `trace --json` prints), and why."""

    model_config = ConfigDict(extra="forbid")
    steps: str | None = Field(default=None, max_length=1000)
    docs: list[dict] | None = Field(default=None, max_length=100_000)
    why: str | None = Field(default=None, max_length=200)


def _unwrap(e: Exception) -> Exception:
    """Ray wraps actor exceptions; the cause is the one with the message."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Exception) else e


def _answered(call, *args, lookup: int | None = None, value: int | None = None,
              headers: dict | None = None, **kwargs):  # fmt: skip
    """`call(*args, **kwargs)`, its errors as HTTP answers (with `headers`): the service busy
    with this kind of work (ServiceBusy) a 503 with Retry-After; a LookupError `lookup`, a
    ValueError `value` (each if given); anything else raised as it is."""
    try:
        return call(*args, **kwargs)
    except Exception as e:
        e = _unwrap(e)
        if type(e).__name__ == "ServiceBusy":
            raise HTTPException(
                503, str(e), headers={**(headers or {}), "Retry-After": "5"}
            ) from None
        for kind, status in ((LookupError, lookup), (ValueError, value)):
            if status is not None and isinstance(e, kind):
                raise HTTPException(status, str(e), headers=headers) from None
        raise


def _swagger_assets() -> Path:
    from swagger_ui_bundle import swagger_ui_path

    return Path(swagger_ui_path)


def create_app(backend: Backend) -> FastAPI:
    """The API over `backend`: open reads (`_reads`), changes and reads of the data that need
    the token (`_guarded`), the live page and the offline /docs (`_pages`)."""
    # The default /docs and /redoc load their assets from a CDN; ours are served locally.
    app = FastAPI(
        title="tokenmill", version="0.1.0", description=__doc__, docs_url=None, redoc_url=None
    )
    app.mount(SWAGGER_STATIC, StaticFiles(directory=_swagger_assets()), name="swagger-static")
    app.add_middleware(GuardMutations)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.include_router(_reads(backend))
    app.include_router(_guarded(backend), dependencies=[Depends(require_token)])
    app.include_router(_pages(app))
    return app


def require_token(request: Request, _: BearerCredentials) -> None:
    """A route's dependency: the request carries the service's token (`token_refusal`)."""
    refusal = token_refusal(request.headers.get("authorization"))
    if refusal:
        raise HTTPException(*refusal)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """A request that does not validate: a 422 naming each field and what is wrong with it."""
    assert isinstance(exc, RequestValidationError)
    msgs = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msgs.append(f"{loc or 'body'}: {err.get('msg')}")
    return JSONResponse(status_code=422, content={"detail": "; ".join(msgs)})


def _reads(backend: Backend) -> APIRouter:
    """What anyone who reaches the API may read: health, status, figures, the mixture, a
    resume state."""
    router = APIRouter()

    @router.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @router.get("/v1/status")
    def status() -> dict:
        return backend.call("status")

    @router.get("/v1/metrics")
    def metrics() -> dict:
        m = backend.call("metrics")
        if isinstance(m, dict):  # one clock for the live page's charts (and the server's samples)
            m.setdefault("server_time", time.time())
        return m

    @router.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> str:
        return prometheus_text(backend.call("metrics"), backend.call("status"))

    @router.get("/v1/mixture")
    def get_mixture() -> dict:
        return backend.call("mixture")

    @router.get(
        "/v1/state",
        summary="A resume state (not authenticated: read-only)",
        description=STATE_DOC,
        responses={
            200: {
                "description": "The state (sealed JSON: version, config_hash, step, digest, ...)",
                "headers": {
                    STATE_AUTH_HEADER: {
                        "description": "Says this route is not authenticated, and why",
                        "schema": {"type": "string"},
                    }
                },
            }
        },
    )
    def state(response: Response, step: int | None = Query(default=None, ge=0, le=2**62)) -> Any:
        response.headers[STATE_AUTH_HEADER] = STATE_AUTH
        # A 503: the mixing policy's loss of that state is not in yet.
        return _answered(backend.call, "state", step, STATE_WAIT_S, lookup=404,
                         headers={STATE_AUTH_HEADER: STATE_AUTH})  # fmt: skip

    return router


def _check_mixture(weights: dict[str, float], streams: list[str]) -> None:
    """A 400 unless `weights` gives every one of `streams` a valid weight, and nothing else."""
    for name, v in weights.items():
        try:
            check_weight(name, v)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
    listed = ", ".join(repr(n) for n in streams)
    unknown = [n for n in weights if n not in streams]
    if unknown:
        names = ", ".join(repr(n) for n in unknown)
        raise HTTPException(
            400, f"unknown stream{'s' if len(unknown) > 1 else ''} {names}; streams are {listed}"
        )
    missing = [n for n in streams if n not in weights]
    if missing:
        names = ", ".join(repr(n) for n in missing)
        raise HTTPException(
            400,
            f"weights must name every stream; missing {names} (a PUT replaces the whole "
            f"mixture, it is not merged: give 0 to turn a stream off; streams are {listed})",
        )


def _guarded(backend: Backend) -> APIRouter:
    """What needs `Authorization: Bearer <token>` (`create_app` adds `require_token`): every
    change of course (mixture, skips, pause, resume) and a step's provenance (it reveals the
    data)."""
    router = APIRouter()

    @router.put(
        "/v1/mixture",
        summary="Replace the mixture weights (all streams)",
        description=PUT_MIXTURE_DOC,
    )
    def put_mixture(update: MixtureUpdate) -> dict:
        _check_mixture(update.weights, list(backend.call("status")["streams"]))
        step = _answered(backend.call, "set_weights", dict(update.weights), value=400)
        return {"effective_step": step}

    @router.post(
        "/v1/skips",
        summary="Leave documents out from the next step made",
        description=SKIPS_DOC,
    )
    def post_skips(request: SkipRequest) -> dict:
        from pipeline.inspect.provenance import parse_steps

        try:
            steps = parse_steps(request.steps) if request.steps is not None else None
        except ValueError as e:
            raise HTTPException(400, f"steps {e}") from None
        if len(steps or []) > 10_000:
            raise HTTPException(400, f"{len(steps or [])} steps: at most 10,000 at once")
        done = _answered(backend.call, "skip", steps, request.docs, request.why,
                         timeout_s=300.0, lookup=400, value=400)  # fmt: skip
        return {"effective_step": done["step"], "left_out": done["left_out"], "why": done["why"]}

    @router.post(
        "/v1/pause",
        summary="Pause the producer",
        description="Ranks keep the steps already made; no new step is made until "
        "`POST /v1/resume`. Needs `Authorization: Bearer <token>`.",
    )
    def pause() -> dict:
        return {"state": _answered(backend.call, "pause")}

    @router.post(
        "/v1/resume",
        summary="Resume the producer",
        description="Undoes `POST /v1/pause`. Needs `Authorization: Bearer <token>`.",
    )
    def resume() -> dict:
        return {"state": _answered(backend.call, "resume")}

    @router.get(
        "/v1/steps/{step}/provenance",
        summary="Which documents fed a step (authenticated: it reveals the data)",
        description="Every segment of the step's rows: stream, source file, record (0-based "
        "line / row / sample), the token range within its document, the rank that got it "
        "(`world_size`: the ranks the rows are split among, default the world served), and "
        "with `text=true` the decoded text. A step the server still holds answers at once; an "
        "older one is recomputed from the newest state kept at or before it (up to 120 s). "
        "Needs `Authorization: Bearer <token>`.",
    )
    def provenance(
        step: int = Path_(ge=0, le=2**62),
        rank: int | None = Query(default=None, ge=0, le=1 << 20),
        world_size: int | None = Query(default=None, ge=1, le=1 << 20),
        text: bool = False,
    ) -> Any:
        if rank is not None:  # a rank the world does not have gets a 400, never an empty 200
            world = world_size or _answered(backend.call, "status").get("world_size") or 1
            if rank >= world:
                raise HTTPException(400, f"rank {rank} is outside world size {world}")
        segs = _answered(backend.call, "provenance", step, world_size, text, timeout_s=120.0,
                         lookup=404, value=400)  # fmt: skip
        return [s for s in segs if rank is None or s["rank"] == rank]

    return router


def _pages(app: FastAPI) -> APIRouter:
    """The live page and /docs, both from files bundled with the service."""
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text()

    # The bundled Swagger UI (4.x) renders OpenAPI 3.0 only; FastAPI writes 3.1. /docs reads
    # the same schema written as 3.0 (only how null is spelled differs); /openapi.json stays 3.1.
    @router.get(DOCS_OPENAPI, include_in_schema=False)
    def docs_openapi() -> dict:
        return openapi_30(app.openapi())

    @router.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=f"{root}{DOCS_OPENAPI}",
            title="tokenmill - API",
            swagger_js_url=f"{root}{SWAGGER_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{SWAGGER_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{SWAGGER_STATIC}/favicon-32x32.png",
        )

    return router


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
