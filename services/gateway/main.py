"""The API gateway: OpenAI-compatible REST + SSE in front of the Tidal bus.

python -m services.gateway --port 8000 [--nats-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator

import nats.errors
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from nats.aio.client import Client as NATS
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.args import add_bus_args
from services.common.bus import BusUnavailable, connect, redact
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import setup_logging
from services.common.protocol import ApiError
from services.gateway.auth import Guard, keyed_by_owner, keys_from
from services.gateway.bus import GatewayBus
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import install as install_openapi
from services.gateway.ratelimit import RateLimiter, add_rate_args
from services.gateway.routers import batches, files, openai, ops
from tidal import envs
from tidal.config.classes import ClassTable, default_table
from tidal.config.cluster import load_config
from tidal.schemas import subjects
from tidal.schemas.messages import Heartbeat

log = logging.getLogger("tidal.gateway")
DEFAULT_CONFIG = "embedded.yaml"  # a shipped config (`tidal.configs`): the built-in classes


def _error_body(message: str, type_: str, code: str | None, param: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return (
        f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid"),
        where or None,
    )


class ArrivalTime:
    """ASGI middleware: stamps each request's arrival before any parsing, for server-side TTFT."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_s"] = time.monotonic()
        await self.app(scope, receive, send)


def create_app(
    nc: NATS,
    gateway_id: str,
    max_inflight: int = 1024,
    api_keys: list[str] | None = None,
    metrics_need_key: bool = False,
    rate_limiter: RateLimiter | None = None,
    classes: ClassTable | None = None,
) -> FastAPI:
    """The gateway app over an open NATS connection (drained when the app shuts down)."""
    subjects.check_token(gateway_id, "gateway id")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bus = GatewayBus(nc, gateway_id, max_inflight, app.state.metrics)
        await bus.start()
        app.state.nc, app.state.bus = nc, bus
        started = time.time()
        app.state.metrics.exporter.me = (started, gateway_id)
        stop = asyncio.Event()

        def beat() -> Heartbeat:
            return Heartbeat(
                service_id=gateway_id,
                kind="gateway",
                pid=os.getpid(),
                started_unix_s=started,
                sent_unix_s=time.time(),
                status="stopped" if stop.is_set() else "ok",
                info={"inflight": str(len(bus.handles))},
            )

        beats = asyncio.create_task(heartbeat_loop(nc, beat, stop, envs.heartbeat_s()))
        log.info("gateway %s connected to %s", gateway_id, redact(nc.connected_url))
        try:
            yield
        finally:
            stop.set()
            await beats
            await nc.drain()

    app = FastAPI(title="Tidal gateway", version="0.1.0", lifespan=lifespan)
    app.state.metrics = GatewayMetrics()
    app.state.gateway_id = gateway_id
    app.state.classes = keyed_by_owner(classes or default_table())
    app.add_middleware(
        Guard, keys=api_keys or [], metrics_need_key=metrics_need_key, rate_limiter=rate_limiter
    )
    app.add_middleware(ArrivalTime)  # outermost: the arrival is stamped before anything else
    app.include_router(openai.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(ops.router)
    install_openapi(app)  # errors as the gateway answers them: 400 etc. in OpenAI's body

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        _log_error(request, exc.status, exc.message)
        headers = {}
        if exc.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return JSONResponse(
            _error_body(exc.message, exc.type, exc.code, exc.param),
            status_code=exc.status,
            headers=headers,
        )

    @app.exception_handler(nats.errors.Error)
    async def _bus_error(request: Request, exc: nats.errors.Error) -> JSONResponse:
        # NOTE: JetStream has no quorum for seconds after a partition heals (a new leader is
        # elected); a store read then failed with a 500 and a traceback. It is the server's
        # passing state, and a client should retry: 503 with Retry-After.
        message = f"the bus or its store is not available now ({exc}); retry shortly"
        _log_error(request, 503, message)
        body = _error_body(message, "server_error", "service_unavailable", None)
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        _log_error(request, 400, message)
        return JSONResponse(_error_body(message, "invalid_request_error", None, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        _log_error(request, exc.status_code, str(exc.detail))
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(_error_body(str(exc.detail), type_, None, None), exc.status_code)

    return app


def _log_error(request: Request, status: int, message: str) -> None:
    """Every error answer is logged with its reason (5xx as warnings: the server's side)."""
    level = logging.WARNING if status >= 500 else logging.INFO
    log.log(level, "%s %s -> %d: %s", request.method, request.url.path, status, message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_bus_args(p)
    p.add_argument("--id", default="gateway-0", help="gateway id (letters, digits, _ -)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--max-inflight", type=int, default=1024, help="429 beyond this many")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this key (repeatable; also TIDAL_API_KEYS, comma-separated); none: open",
    )
    p.add_argument("--metrics-need-key", action="store_true", help="/metrics asks for a key too")
    p.add_argument(
        "--config",
        default="",
        help="cluster config YAML whose request classes it serves (`classes:`, docs/classes.md; "
        "default: configs/embedded.yaml, the built-in online/offline pair)",
    )
    add_rate_args(p)
    return p.parse_args(argv)


def _limiter(args: argparse.Namespace) -> RateLimiter | None:
    return RateLimiter(args.rate_limit, args.rate_burst) if args.rate_limit else None


async def serve(args: argparse.Namespace) -> None:
    subjects.check_token(args.id, "gateway id")
    limiter = _limiter(args)
    # Connect before uvicorn starts: an unreachable bus is a one-line error, not a traceback.
    nc = await connect(args.nats_url, f"gateway-{args.id}", args.connect_timeout_s)
    keys = keys_from(args.api_key)
    classes = load_config(args.config or DEFAULT_CONFIG).classes
    app = create_app(nc, args.id, args.max_inflight, keys, args.metrics_need_key, limiter, classes)
    if keys:
        log.info("gateway %s: %d API key(s) accepted", args.id, len(keys))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    await server.serve()
    if not server.started:
        raise RuntimeError(f"could not listen on {args.host}:{args.port}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("gateway")
    try:
        asyncio.run(serve(args))
    except (BusUnavailable, ValueError, RuntimeError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1 if not isinstance(exc, ValueError) else 2
    return 0
