"""The HTTP front end: a FastAPI app around a Frontend, and the uvicorn protocol that bounds what a
connection may cost before a request exists (header size and time; idle sockets are closed).

A request's path: Guard (auth, body size and time) -> FastClassify (a valid /v1/classify JSON body
skips FastAPI's routing layers, ~0.1 ms) or FastAPI's routes -> Frontend -> engine client. Routes in
other servers' shapes (vLLM's /classify, TEI's /predict, /rerank, /v1/models, ...): compat.py.
FastAPI and uvicorn are imported where the app is built: importing them costs about a second,
and every CLI command imports the package that registers `serve`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import time

import msgspec

from . import compat, fanout
from .answers import label_probs
from .config import MAX_TIMEOUT_S
from .admission import request_tenant
from .frontend import DEADLINE, TENANT, ApiError, Frontend
from .schemas import (ERRORS, AnyClassifyRequest, AnyScoreRequest, ClassifyManyResponse,
                      ClassifyRequest, ClassifyResponse, ScoreResponse, VllmClassifyRequest,
                      VllmClassifyResponse, VllmScoreRequest, VllmScoreResponse)

PATHS = ("/v1/classify", "/v1/score", "/healthz", "/metrics", "/docs", "/redoc", "/openapi.json",
         *compat.PATHS)
WATCH_AFTER = 0.01  # seconds before a request's disconnect is watched (Guard)
UNAUTHORIZED = "missing or wrong API key: send 'Authorization: Bearer KEY'"


def endpoint(path: str) -> str:
    """The endpoint label of a response's metrics: the path if it is a route, else "other"."""
    return path if path in PATHS else "other"


def authorized(headers: list, api_key: str) -> bool:
    """Exactly one Authorization header, carrying the API key as a bearer token (two headers are
    refused: proxies and frameworks disagree on which one counts)."""
    values = [v for k, v in headers if k == b"authorization"]
    if len(values) != 1:
        return False
    scheme, _, token = values[0].decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class Guard:
    """Outermost ASGI layer, the one auth check: counts responses by endpoint and status (499 when
    the client left first) and times them, answers 401 on /v1/* and the compatible routes that
    compute without the API key before anything is read, and reads request bodies up to the size
    limit (413) within the body timeout (408). Its errors take the route's peer shape (compat)."""

    def __init__(self, app, frontend: Frontend):
        self.app, self.fe = app, frontend
        cfg = frontend.cfg
        self.max_body, self.api_key, self.body_timeout = cfg.max_body_bytes, cfg.api_key, cfg.body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 499  # no response started: the client left (or the task was cancelled)

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        label = endpoint(path)
        t0 = time.perf_counter()
        try:
            if self.api_key is not None and (path.startswith("/v1/") or path in compat.AUTHED) and \
                    not authorized(scope["headers"], self.api_key):
                return await send_json(counted, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")],
                                       close=True, path=path)
            if scope["method"] not in ("POST", "PUT", "PATCH"):
                return await self.app(scope, receive, counted)
            deadline, error = request_deadline(scope["headers"])
            tenant, error2 = request_tenant(scope["headers"], scope.get("client"))
            if error or error2:
                return await send_json(counted, 400, error or error2, close=True, path=path)
            body, error = await self._read(scope, receive)
            if error:
                return await send_json(counted, *error, close=True, path=path)
            if deadline is not None:  # for the Frontend, in this task (the route runs in it)
                DEADLINE.set(deadline)
            TENANT.set(tenant)
            # A client that leaves before its answer: the request is cancelled, which drops its
            # queued engine work (Frontend._wait), and it is counted 499, not computed and 200.
            # The watch starts only for a request still running after WATCH_AFTER: a task made
            # and cancelled for every request cost a front end ~5% of its CPU, and one that
            # leaves sooner is answered in about the time it takes to notice.
            task, gone, watcher = asyncio.current_task(), False, None

            async def watch():
                nonlocal gone
                message = await receive()  # after the body: the next message is the disconnect
                if message["type"] == "http.disconnect" and status == 499:  # nothing sent yet
                    gone = True
                    task.cancel()

            def start_watch():
                nonlocal watcher
                watcher = asyncio.get_running_loop().create_task(watch())

            timer = asyncio.get_running_loop().call_later(WATCH_AFTER, start_watch)
            try:
                await self.app(scope, replay(body, receive), counted)
            except asyncio.CancelledError:
                if not gone:
                    raise
            finally:
                timer.cancel()
                if watcher is not None:
                    watcher.cancel()
        except asyncio.CancelledError:
            # uvicorn cancels what is left when the drain ends (a body still uploading, say):
            # answered like the rest of the backlog, 503 + Retry-After, not uvicorn's 500
            if status != 499 or not self.fe.draining:
                raise
            await send_json(counted, 503, "the server is shutting down and this request did not "
                            "finish within --shutdown-timeout; retry on another instance",
                            [(b"retry-after", b"1")], close=True, path=path)
        finally:
            metrics = self.fe.metrics
            metrics.requests.labels(label, str(status)).inc()
            metrics.route(label).observe(time.perf_counter() - t0)

    async def _read(self, scope, receive):
        too_big = (413, f"request body over the limit of {self.max_body} bytes (--max-body-bytes)")
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                return b"", too_big
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", (408, f"request body not received within {self.body_timeout:g} s "
                                  f"(--body-timeout)")
            if message["type"] == "http.disconnect":
                return b"", (400, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); say so instead of a generic parse error
        except UnicodeDecodeError as e:
            return b"", (400, f"request body is not valid UTF-8 (byte {e.start})")
        return body, None


SECONDS = re.compile(rb"[0-9]+(\.[0-9]*)?|\.[0-9]+")  # a plain decimal number (no 1_0, 1e3, inf)


def request_deadline(headers: list) -> tuple[float | None, str | None]:
    """X-Request-Timeout: SECONDS -> (the deadline as time.monotonic(), None), or an error text
    (not a plain decimal number of seconds in range; more than one such header)."""
    values = [value for name, value in headers if name == b"x-request-timeout"]
    if not values:
        return None, None
    if len(values) > 1:
        return None, f"{len(values)} X-Request-Timeout headers; send one"
    value = values[0]
    t = float(value) if SECONDS.fullmatch(value) else -1.0
    if not 0 < t <= MAX_TIMEOUT_S:
        return None, (f"X-Request-Timeout must be a plain decimal number of seconds in (0, "
                      f"{MAX_TIMEOUT_S:g}], got {value.decode('latin-1')!r}")
    return time.monotonic() + t, None


class FastClassify:
    """POST /v1/classify without FastAPI's routing and dependency layers: a JSON body that the
    route's own pydantic model accepts goes straight to the route's handler; anything else falls
    through to the FastAPI route, which answers it exactly as before."""

    def __init__(self, app, answer):
        self.app, self.answer = app, answer

    async def __call__(self, scope, receive, send):
        if scope["path"] != "/v1/classify" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        ctype = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            return await self.app(scope, receive, send)
        message = await receive()
        body = message.get("body", b"")
        try:
            req = ClassifyRequest.model_validate_json(body)
        except ValueError:  # pydantic's ValidationError: FastAPI words the 422
            return await self.app(scope, replay(body, receive), send)
        try:
            status, out, extra = 200, await self.answer(req), []
        except ApiError as e:
            status, out = e.status, json.dumps({"detail": e.detail}).encode()
            extra = [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
        await send_body(send, status, out, extra)


_encode = msgspec.json.Encoder().encode


def classify_body(ans) -> bytes:
    """The ClassifyResponse JSON, built here (the schema documents it; FastAPI would validate it
    a second time on the way out), by msgspec, far faster than json.dumps for this body (which took a
    real share of a front end's CPU per request on a GPU host). A score that is
    not finite is written null (JSON has no NaN or Infinity)."""
    labels = ans.labels
    return _encode({"results": [{"query": q, "label": l, "scores": dict(zip(labels, sc)),
                                 "probs": dict(zip(labels, label_probs(sc)[0])), "cached": c}
                                for q, l, sc, c in ans.results],
                    "batch_size": ans.batch_size,
                    "timing": {"queue_ms": 1e3 * ans.queue_s, "tokenize_ms": 1e3 * ans.tokenize_s,
                               "forward_ms": 1e3 * ans.forward_s, "total_ms": 1e3 * ans.total_s}})


def create_app(frontend: Frontend, on_startup=None, on_shutdown=None):
    """The ASGI app around one Frontend. on_startup/on_shutdown: called from the app's lifespan
    (start and stop the engine client)."""
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from fastapi.security import HTTPBearer

    fe = frontend

    @asynccontextmanager
    async def lifespan(app):
        if on_startup:
            on_startup(asyncio.get_running_loop())
        yield
        if on_shutdown:
            on_shutdown()

    class App(FastAPI):
        """HTTP requests enter through Guard and FastClassify (app.front) before FastAPI's own
        layers; everything that is not a valid /v1/classify body continues into them."""

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                await self.front(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)

    app = App(title="prefixscore", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
              description="Which of N labels does this causal LLM pick for this text.")
    offline_docs(app)
    inner = super(App, app).__call__
    app.state.frontend = fe
    # Guard is the one auth check; this only documents the scheme in the OpenAPI schema.
    deps = [Depends(HTTPBearer(auto_error=False))] if fe.cfg.api_key else []

    def http_error(e: ApiError) -> HTTPException:
        return HTTPException(e.status, e.detail, headers=e.headers or None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype:
            detail += f" (the body must be JSON sent with content-type: application/json, got {ctype!r})"
        shape = compat.shape_of(request.url.path, getattr(exc, "body", None))
        if shape is not None:  # a compatible route: its peer's shape and status
            status, body = shape.invalid(detail)
            return JSONResponse(body, status_code=status)
        return JSONResponse({"detail": detail, "errors": errors}, status_code=422)

    async def answer_classify(req: ClassifyRequest) -> bytes:
        if req.classifiers is not None:  # several classifiers: fanout.py
            return await fanout.answer(fe, req)
        queries = [req.query] if isinstance(req.query, str) else req.query
        return classify_body(await fe.classify(queries, req.model, req.classifier,
                                               priority=req.priority))

    @app.post("/v1/classify", response_model=ClassifyResponse | ClassifyManyResponse | VllmClassifyResponse,
              responses=ERRORS, dependencies=deps)
    async def classify(req: AnyClassifyRequest):
        """Label and per-label scores for one query or a list of queries, by the classifier the
        request names (`classifier` or `model`; default: the first served), or by several
        (`classifiers`: a ClassifyManyResponse, per query a result per classifier). vLLM's body
        (`input`, as SGLang documents this route) gets vLLM's answer (/classify's)."""
        if isinstance(req, VllmClassifyRequest):
            return await compat.vllm_classify(fe, req)
        try:
            return Response(await answer_classify(req), media_type="application/json")
        except ApiError as e:
            raise http_error(e) from None

    @app.post("/v1/score", response_model=ScoreResponse | VllmScoreResponse, responses=ERRORS,
              dependencies=deps)
    async def score(req: AnyScoreRequest):
        """SGLang-compatible multi-item scoring: per item, the labels' scores after query + item.
        apply_softmax=true: softmax over the labels; false: each label token's probability under the
        whole vocabulary (SGLang's default). vLLM's body (text_1/text_2) gets vLLM's answer
        (/score's)."""
        if isinstance(req, VllmScoreRequest):
            return await compat.vllm_score(fe, req)
        try:  # only the fields the client sent: the scorer tells "item_first absent" from "false"
            out = await fe.score(req.model_dump(exclude_unset=True))
        except ApiError as e:
            raise http_error(e) from None
        return ScoreResponse(**{**out, "model": fe.info.model})

    @app.get("/healthz", responses={503: {"description": "starting, unhealthy, or shutting down"}})
    @app.head("/healthz", include_in_schema=False)  # probes that send HEAD (RFC 9110: supported)
    async def healthz():
        """Ready once the engine has cached the prefix and run a first batch; unhealthy while the
        engine is down (an engine fault), until a restarted one is ready."""
        status, body = fe.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=Response)
    @app.head("/metrics", include_in_schema=False)
    async def prometheus():
        """Prometheus text format, summed over every process of the server."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(fe.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    compat.register(app, fe, deps)
    full_schema = app.openapi

    def openapi():
        """The schema lists what this server can do: /v1/score and rerank only with a scorer
        (known once the engine is ready)."""
        schema = full_schema()
        if fe.client.info is not None and fe.client.info.scorer is None:
            scoring = ("/v1/score", *compat.RERANK)
            schema = {**schema, "paths": {k: v for k, v in schema["paths"].items() if k not in scoring}}
        return schema

    app.openapi = openapi
    app.front = Guard(FastClassify(inner, answer=answer_classify), fe)
    return app


DOCS_ASSETS = "/docs-assets"


def offline_docs(app) -> None:
    """/docs (Swagger UI) and /redoc with their scripts served from here (fastapi-offline's copies):
    FastAPI's own pages load them from a CDN, blank on a host without the internet."""
    from pathlib import Path

    import fastapi_offline
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount(DOCS_ASSETS, StaticFiles(directory=Path(fastapi_offline.__file__).parent / "static"),
              name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc():
        return get_redoc_html(openapi_url=app.openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png", with_google_fonts=False)


def replay(body: bytes, receive):
    sent = False

    async def again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again


async def send_body(send, status: int, body: bytes, headers=()) -> None:
    """A whole JSON response straight to the ASGI server."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, detail: str, headers=(), close: bool = False,
                    path: str = "") -> None:
    """An error as {"detail": ...}, or in the peer's shape on a compatible route (path); close: the
    connection closes after it (the body was not read)."""
    extra = [(b"connection", b"close")] if close else []
    shaped = compat.error_body(path, status, detail)
    status, body = shaped or (status, json.dumps({"detail": detail}).encode())
    await send_body(send, status, body, [*extra, *headers])
