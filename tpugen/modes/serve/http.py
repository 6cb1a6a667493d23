"""The server's HTTP side: one FastAPI app, its routers, the API key, limits, and errors as one line each."""

from __future__ import annotations

import hmac
import html
from contextlib import asynccontextmanager

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpugen import __version__
from tpugen.config.messages import format_error
from tpugen.errors import InputError, TpugenError, one_line
from tpugen.modes.serve import a1111, controlnet_api, openai_api, ops, page, runs_api
from tpugen.modes.serve.browsers import SECURITY_HEADERS, host_problem, is_loopback, origin_problem
from tpugen.modes.serve.queue import QueueFull
from tpugen.modes.serve.replies import TooLarge, WrongType, body_limit, problem_response, too_large
from tpugen.modes.serve.request_ids import RequestIds, offered_key
from tpugen.modes.serve.service import Conflict, NotReady, Service, TimedOut, TooManyRuns

# Answered without the API key, and while draining; the page's files hold no data (each call it makes has the key).
OPEN_PATHS = ("/healthz", "/readyz", *page.OPEN_PATHS)
# Answered while the model loads (no engine yet), besides OPEN_PATHS and reading runs: nothing here needs one.
ENGINE_FREE_PATHS = ("/metrics", "/docs", "/openapi.json")


class SlowBody(InputError):
    """A body whose next part did not come within serve.read_timeout_s (408)."""


def slow_body(seconds: float) -> str:
    return f"the body stopped arriving: no part of it came for {seconds:g} s (serve.read_timeout_s)"


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, SlowBody):
        return 408
    if isinstance(exc, WrongType):
        return 415
    if isinstance(exc, (NotReady, QueueFull)):
        return 503
    if isinstance(exc, TimedOut):
        return 504
    if isinstance(exc, TooManyRuns):
        return 429
    if isinstance(exc, Conflict):
        return 409
    if isinstance(exc, InputError):
        return 422
    return 500


def docs_page(schema: dict) -> str:
    """The server's routes as one self-contained HTML page (nothing loaded from elsewhere): each method and path
    with its summary, and the schema's address for clients that read it."""
    rows = []
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            summary = operation.get("summary") or ""
            first = (operation.get("description") or "").strip().split("\n\n")[0].replace("\n", " ")
            rows.append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                f"<td>{html.escape(first or summary)}</td></tr>"
            )
    info = schema.get("info", {})
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>tpugen API</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{padding:.3em .8em;vertical-align:top}</style></head><body>"
        f"<h1>{html.escape(str(info.get('title', 'tpugen')))} {html.escape(str(info.get('version', '')))}</h1>"
        "<p>The OpenAPI schema: <a href='openapi.json'>openapi.json</a>. Each route takes the API key, as "
        "<code>Authorization: Bearer KEY</code> or basic auth with the key as the password.</p>"
        f"<table>{''.join(rows)}</table></body></html>"
    )


def require_key(api_key: str | None):
    """The API key check, as a dependency: `Authorization: Bearer KEY` (OpenAI clients) or HTTP basic auth with
    the key as the password (A1111 clients, --api-auth). Compared in constant time; never logged."""

    def check(request: Request) -> None:
        if not has_key(request, api_key):
            raise Unauthorized()

    return check


def has_key(request: Request, api_key: str | None) -> bool:
    """Whether the request carries `api_key` (None: no key is needed)."""
    if api_key is None:
        return True
    offered = offered_key(request.headers.get("authorization", ""))
    return hmac.compare_digest(offered.encode(), api_key.encode())


def _unauthorized():
    lines = ["an API key is needed: Authorization: Bearer KEY, or basic auth with the key as the password"]
    return problem_response(401, lines, {"WWW-Authenticate": 'Bearer, Basic realm="tpugen"'})


class Unauthorized(Exception):
    """No API key, or another one."""


def build_app(service: Service, api_key: str | None, host: str | None = None) -> FastAPI:
    """The app: routers for the A1111 API, the OpenAI images API, tpugen runs and operations. `host`: the address
    the server is bound to (a loopback one answers loopback Host names only); None checks no Host."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio.to_thread

        # Each request waits for its images in a worker thread: room for every request the queue takes.
        anyio.to_thread.current_default_thread_limiter().total_tokens = service.serve.max_queue + 16
        service.start()
        yield
        service.stop()

    # /docs and /openapi.json are on, behind the key like every route but /healthz and /readyz. /docs is tpugen's
    # own page, made from the schema: Swagger UI would load its scripts from a CDN, which a TPU VM without
    # internet cannot reach.
    app = FastAPI(title="tpugen", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    secured = [Depends(require_key(api_key))]
    app.include_router(ops.router)
    app.include_router(ops.metrics_router, dependencies=secured)
    app.include_router(a1111.router, dependencies=secured)
    app.include_router(a1111.internal_router, dependencies=secured)
    app.include_router(controlnet_api.router, dependencies=secured)
    app.include_router(openai_api.router, dependencies=secured)
    app.include_router(runs_api.router, dependencies=secured)
    app.include_router(page.router)
    app.include_router(page.api_router, dependencies=secured)

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        lines = []
        for error in exc.errors():
            error = dict(error)
            error["loc"] = tuple(part for part in error.get("loc", ()) if part != "body") or ("body",)
            lines.append("body: not valid JSON" if error.get("type") == "json_invalid" else format_error(error))
        return problem_response(422, lines)

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized):
        return _unauthorized()

    @app.exception_handler(TpugenError)
    async def tpugen_error(request: Request, exc: TpugenError):
        status = _status_of(exc)
        retry = {503: {"Retry-After": "5"}, 429: {"Retry-After": "30"}}.get(status)  # a run takes a while
        return problem_response(status, exc.lines or [one_line(exc)], retry)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull):
        return problem_response(503, [f"the server is busy: {exc}; try again shortly"], {"Retry-After": "2"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            line = f"{request.url.path}: no such endpoint here (tpugen serves the A1111, OpenAI images and runs APIs)"
        elif exc.status_code == 405:
            allowed = {key.lower(): value for key, value in (exc.headers or {}).items()}.get("allow", "-")
            line = f"{request.method} {request.url.path}: not served here (allowed: {allowed})"
        else:
            line = str(exc.detail)
        return problem_response(exc.status_code, [line], exc.headers)

    def unforeseen(exc: Exception):
        # Raised in a task group (a middleware's): an exception group of one (Python 3.11's; anyio's before).
        while len(getattr(exc, "exceptions", ())) == 1 and isinstance(exc.exceptions[0], BaseException):
            exc = exc.exceptions[0]
        if isinstance(exc, (TooLarge, SlowBody)):  # found while the body came: the rest of it is never read
            return problem_response(_status_of(exc), exc.lines or [one_line(exc)], {"Connection": "close"})
        if isinstance(exc, TpugenError):
            return problem_response(_status_of(exc), exc.lines or [one_line(exc)])
        if isinstance(exc, RecursionError):  # json or YAML nested thousands deep
            return problem_response(422, ["body: nested too deeply to read"])
        return problem_response(500, [one_line(exc)])

    app.add_exception_handler(Exception, lambda request, exc: unforeseen(exc))

    controlnets = bool(service.run.config.model.controlnets)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        # While draining, runs can still be read: a client fetches what a stopped run wrote.
        reading_runs = request.method == "GET" and (path == "/v1/runs" or path.startswith("/v1/runs/"))
        if path not in OPEN_PATHS and not has_key(request, api_key):
            # Here, before any route: every path is behind the key, the docs and the schema included.
            response = _unauthorized()
        elif service.state == "draining" and path not in OPEN_PATHS and not reading_runs:
            response = problem_response(503, ["the server is shutting down"], {"Retry-After": "30"})
        elif not service.engines and path not in OPEN_PATHS + ENGINE_FREE_PATHS and not reading_runs:
            line = service.failure or f"the server is loading {service.run.config.model.id}; GET /readyz says when"
            response = problem_response(503, [line], {"Retry-After": "5"})
        elif int(request.headers.get("content-length") or 0) > (limit := body_limit(path, controlnets)):
            response = problem_response(413, [too_large(limit)], {"Connection": "close"})
        else:
            try:
                response = await call_next(request)
            except Exception as exc:  # what no handler answered: counted here, or a 5xx would go unseen
                response = unforeseen(exc)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", None) or "unknown"
        service.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
        return response

    serve = service.serve
    app.add_middleware(
        Guarded,
        loopback_only=host is not None and is_loopback(host),
        allowed_hosts=list(serve.allowed_hosts),
        allowed_origins=list(serve.allowed_origins),
        read_timeout_s=serve.read_timeout_s,
        controlnets=controlnets,
    )
    # Added last, so outermost: every response, the guard's and the error handlers' included, carries the id.
    app.add_middleware(RequestIds)
    return app


class Guarded:
    """The outermost layer: a request's Host and Origin checked before anything reads it, its body counted as it
    arrives (over its route's limit: 413, whatever the framing; a part late by read_timeout_s: 408), and the
    security headers on every reply."""

    def __init__(
        self,
        app,
        *,
        loopback_only: bool,
        allowed_hosts: list[str],
        allowed_origins: list[str],
        read_timeout_s: float = 30.0,
        controlnets: bool = False,
    ) -> None:
        self.app = app
        self.controlnets = controlnets  # the server has ControlNets: txt2img takes image-sized bodies
        self.loopback_only = loopback_only
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in SECURITY_HEADERS if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", [])}
        host = headers.get("host")
        problem = host_problem(host, loopback_only=self.loopback_only, allowed=self.allowed_hosts)
        status = 400
        if problem is None:
            problem = origin_problem(headers.get("origin"), host, scope.get("scheme", "http"), self.allowed_origins)
            status = 403
        if problem is not None:
            return await problem_response(status, [problem])(scope, receive, with_headers)

        limit, seen, whole = body_limit(scope["path"], self.controlnets), 0, False

        async def counted():
            nonlocal seen, whole
            if whole:  # what follows a whole body is the client leaving: a stream's wait, not timed
                return await receive()
            try:
                with anyio.fail_after(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise SlowBody(slow_body(self.read_timeout_s)) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise TooLarge(too_large(limit))
                whole = not message.get("more_body", False)
            return message

        await self.app(scope, counted, with_headers)
