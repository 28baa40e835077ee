"""The gRPC front end (proto/prefixscore.proto): Classify and Score beside the HTTP routes, on the
same event loop and the same Frontend, so the semantics, limits, API key, admission and metrics
are the HTTP routes' own. Search back ends talk gRPC.

    server = await start_grpc(frontend, host, port)   # listening (SO_REUSEPORT: workers share it)
    ...
    await stop_grpc(server, grace)                     # in-flight calls finish within grace

A call's path: the API key (metadata `authorization: Bearer KEY`, checked by http.authorized) ->
the request as the HTTP route would see it -> Frontend -> the answer, or the ApiError as a status
(CODES; the HTTP detail text as its message, `http-status` and `retry-after` as trailing
metadata). Each call is counted in the requests metric as endpoint "grpc:<Method>" with the HTTP
status it would have had (499: the client cancelled or its deadline passed; the awaited Frontend
call is cancelled with it, which drops queued engine work). A message over --max-body-bytes is
refused by gRPC itself (RESOURCE_EXHAUSTED), before any handler: not counted.

Also /grpc.health.v1.Health/Check (no API key, as /healthz): SERVING once the engine is ready;
and server reflection (grpcurl list / describe).
"""
from __future__ import annotations

import logging
import time
import socket

from ..errors import ConfigError

try:
    import grpc
except ImportError:  # pragma: no cover
    raise ConfigError("--grpc-port needs grpcio and protobuf: pip install 'prefixscore[grpc]'") from None

from google.protobuf.message import DecodeError

from .frontend import DEADLINE, TENANT, ApiError, Frontend
from .admission import request_tenant
from .http import UNAUTHORIZED, authorized
from .proto import prefixscore_pb2 as pb

log = logging.getLogger("prefixscore.grpc")

SERVICE = "prefixscore.v1.PrefixScore"
HEALTH = "grpc.health.v1.Health"
C = grpc.StatusCode
CODES = {
    401: C.UNAUTHENTICATED,
    404: C.NOT_FOUND,  # Health/Check of an unknown service (the health protocol's answer)
    408: C.DEADLINE_EXCEEDED,
    # Over a limit: retrying the same request cannot help, so not RESOURCE_EXHAUSTED, which
    # (with retry-after) means "retry later" only. http-status tells 413 from 422.
    413: C.INVALID_ARGUMENT,
    422: C.INVALID_ARGUMENT,
    429: C.RESOURCE_EXHAUSTED,
    501: C.UNIMPLEMENTED,
    503: C.UNAVAILABLE,
    504: C.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    return CODES.get(status, C.INVALID_ARGUMENT if 400 <= status < 500 else C.INTERNAL)


# ---------------------------------------------------------------- messages <-> Frontend

def _item(it):
    """An Item as /v1/score's JSON item: text, {"embedding": bytes, "dtype"?} or {"id"} (an Item
    with nothing set: {} , which ScoreInput refuses naming the item)."""
    which = it.WhichOneof("item")
    if which == "text":
        return it.text
    if which == "embedding":
        return {"embedding": it.embedding, **({"dtype": it.dtype} if it.HasField("dtype") else {})}
    return {"id": it.id} if which == "id" else {}


def score_dict(m) -> dict:
    """A ScoreRequest as the dict Frontend.score takes: what the HTTP route's
    model_dump(exclude_unset=True) gives for the same request (only the fields the client set;
    item_first absent is not item_first false)."""
    req = {}
    which = m.WhichOneof("query")
    if which == "query_text":
        req["query"] = m.query_text
    elif which == "query_ids":
        req["query"] = list(m.query_ids.ids)
    which = m.WhichOneof("items")
    if which == "item_texts":
        req["items"] = list(m.item_texts.values)
    elif which == "item_ids":
        req["items"] = [list(t.ids) for t in m.item_ids.values]
    elif which == "item_list":
        req["items"] = [_item(it) for it in m.item_list.values]
    if m.label_token_ids:
        req["label_token_ids"] = list(m.label_token_ids)
    if m.labels:
        req["labels"] = list(m.labels)
    for name in ("apply_softmax", "item_first", "model"):
        if m.HasField(name):
            req[name] = getattr(m, name)
    if m.priority:
        req["priority"] = m.priority
    if m.prior:
        req["prior"] = list(m.prior)
    return req


def handlers(fe: Frontend):
    """method name -> async handler(request message) -> response message, per service."""

    async def classify(m):
        ans = await fe.classify(list(m.queries), m.model if m.HasField("model") else None,
                                m.classifier if m.HasField("classifier") else None,
                                priority=m.priority)
        labels = ans.labels
        index = {label: i for i, label in enumerate(labels)}
        R = pb.ClassifyResult
        return pb.ClassifyResponse(
            labels=labels,
            results=[R(query=q, label=label, label_index=index[label], scores=scores, cached=cached)
                     for q, label, scores, cached in ans.results],
            batch_size=ans.batch_size,
            timing=pb.Timing(queue_ms=1e3 * ans.queue_s, tokenize_ms=1e3 * ans.tokenize_s,
                             forward_ms=1e3 * ans.forward_s, total_ms=1e3 * ans.total_s),
            classifier=ans.classifier)

    async def score(m):
        out = await fe.score(score_dict(m))
        usage = out.get("usage")
        return pb.ScoreResponse(
            scores=[pb.ItemScores(values=s or ()) for s in out["scores"]], labels=out["labels"],
            model=fe.info.model, depth=out.get("depth", 0), scored=out.get("scored", ()),
            cached=out.get("cached", 0),
            usage=None if usage is None else pb.Usage(
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
                total_tokens=usage.get("total_tokens", 0)))

    async def check(m):
        if m.service not in ("", SERVICE):
            raise ApiError(404, f"unknown service {m.service!r}")
        status, _ = fe.health()
        R = pb.HealthCheckResponse
        return R(status=R.SERVING if status == 200 else R.NOT_SERVING)

    return {
        SERVICE: {"Classify": (classify, pb.ClassifyRequest, pb.ClassifyResponse, True),
                  "Score": (score, pb.ScoreRequest, pb.ScoreResponse, True)},
        HEALTH: {"Check": (check, pb.HealthCheckRequest, pb.HealthCheckResponse, False)},
    }


def unary(fe: Frontend, endpoint: str, handle, auth: bool, parse):
    """The gRPC method around handle: API key, the request's bytes parsed (here, not by grpc,
    whose failed deserializer answers UNKNOWN: a malformed message is INVALID_ARGUMENT), ApiError
    -> status, the requests metric."""
    api_key = fe.cfg.api_key if auth else None
    requests = fe.metrics.requests

    async def call(request, context):
        # Counted before the answer leaves: context.abort sends the status and only then raises,
        # so a count in `finally` could land after the client has read the reply.
        status = None
        try:
            if api_key is not None and not authorized(bearer(context), api_key):
                error = ApiError(401, UNAUTHORIZED)
            else:
                remaining = context.time_remaining()
                if remaining is not None:  # the call's deadline is the request's (frontend.DEADLINE)
                    DEADLINE.set(time.monotonic() + remaining)
                try:
                    TENANT.set(call_tenant(context))
                    reply = await handle(_parsed(parse, request))
                except ApiError as e:
                    error = e
                else:
                    status = 200
                    requests.labels(endpoint, "200").inc()
                    return reply
            status = error.status
            requests.labels(endpoint, str(status)).inc()
            trailers = [("http-status", str(error.status))]
            trailers += [(k.lower(), v) for k, v in error.headers.items()]
            await context.abort(grpc_code(status), error.detail, tuple(trailers))
        except grpc.aio.AbortError:
            raise
        except Exception:
            status = 500
            requests.labels(endpoint, "500").inc()
            log.exception("%s failed", endpoint)
            await context.abort(C.INTERNAL, "internal server error", (("http-status", "500"),))
        finally:
            if status is None:  # cancelled (the client left or its deadline passed)
                requests.labels(endpoint, "499").inc()

    return call


def _parsed(parse, data: bytes):
    try:
        return parse(data)
    except DecodeError as e:
        raise ApiError(400, f"a malformed request message: {e}") from None


def bearer(context) -> list[tuple[bytes, bytes]]:
    """The call's authorization metadata as the HTTP headers http.authorized checks (every entry:
    two are refused there, as two HTTP headers are)."""
    return [(b"authorization", v.encode("latin-1", "replace") if isinstance(v, str) else v)
            for k, v in context.invocation_metadata() or () if k == "authorization"]


def call_tenant(context) -> int:
    """The call's client, as http.request_tenant reads an HTTP request's: x-client-id metadata,
    else the peer's address (ApiError 400 for a bad or repeated x-client-id)."""
    headers = [(b"x-client-id", v.encode("latin-1", "replace") if isinstance(v, str) else v)
               for k, v in context.invocation_metadata() or () if k == "x-client-id"]
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:..."
    tenant, error = request_tenant(headers, (peer.rpartition(":")[0] or peer,))
    if error:
        raise ApiError(400, error)
    return tenant


# ---------------------------------------------------------------- the server

def check_port(host: str, port: int) -> None:
    """Before anything slow (the launcher, as bind() does for HTTP): ConfigError when host:port
    is taken. Only a free port passes: start_grpc's SO_REUSEPORT would share one that another
    prefixscore server holds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen for gRPC on {host}:{port}: {e.strerror} "
                              f"(--host/--grpc-port)") from None


def _reflection(server) -> None:
    """Server reflection (grpcio-reflection, in the grpc extra), so grpcurl-style tools list and
    call the service without the .proto; without the package, none (said once in the log)."""
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        log.info("no gRPC server reflection: pip install grpcio-reflection (prefixscore[grpc])")
        return
    reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)


async def start_grpc(frontend: Frontend, host: str, port: int) -> grpc.aio.Server:
    """A grpc.aio server on the running event loop (uvicorn's; uvloop works), started and
    listening on host:port with SO_REUSEPORT, so several front-end processes share the port.
    Port 0: a free port, in `server.port`. ConfigError when it cannot listen."""
    cfg = frontend.cfg
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 1),
                 ("grpc.max_receive_message_length", cfg.max_body_bytes)],
        # As HTTP's --max-connections: beyond it gRPC answers RESOURCE_EXHAUSTED itself; it
        # exceeds --max-queue, so overload is the Frontend's 429 first.
        maximum_concurrent_rpcs=cfg.max_connections)
    for service, methods in handlers(frontend).items():
        table = {name: grpc.unary_unary_rpc_method_handler(
                     unary(frontend, f"grpc:{name}" if service == SERVICE else f"grpc:Health/{name}",
                           handle, auth, req.FromString),
                     response_serializer=resp.SerializeToString)
                 for name, (handle, req, resp, auth) in methods.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, table),))
        if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63: a faster lookup
            server.add_registered_method_handlers(service, table)
    _reflection(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        bound, reason = 0, str(e)
    else:
        reason = "port in use?"
    if not bound:
        raise ConfigError(f"cannot listen for gRPC on {address}: {reason} (--host/--grpc-port)")
    server.port = bound
    await server.start()
    log.info("serving gRPC (%s) on %s", SERVICE, f"{host}:{bound}")
    return server


async def stop_grpc(server: grpc.aio.Server, grace: float) -> None:
    """New calls are refused (UNAVAILABLE) at once; calls in flight get up to grace seconds to
    finish, then are cancelled (which aborts their engine work)."""
    await server.stop(grace)
