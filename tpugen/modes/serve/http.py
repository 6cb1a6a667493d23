"""The server's HTTP side: one FastAPI app, its routers, the API key, limits, and errors as one line each."""

from __future__ import annotations

import base64
import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpugen import __version__
from tpugen.config.messages import format_error
from tpugen.errors import InputError, TpugenError, one_line
from tpugen.modes.serve import a1111, openai_api, ops, page, runs_api
from tpugen.modes.serve.queue import QueueFull
from tpugen.modes.serve.replies import TooLarge, body_limit, problem_response, too_large
from tpugen.modes.serve.request_ids import RequestIds
from tpugen.modes.serve.service import Conflict, NotReady, Service, TimedOut, TooManyRuns

# Answered without the API key, and while draining; the page's files hold no data (each call it makes has the key).
OPEN_PATHS = ("/healthz", "/readyz", *page.OPEN_PATHS)
# Answered while the model loads (no engine yet), besides OPEN_PATHS and reading runs: nothing here needs one.
ENGINE_FREE_PATHS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json")


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, TooLarge):
        return 413
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
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    offered = ""
    if scheme.lower() == "bearer":
        offered = value.strip()
    elif scheme.lower() == "basic":
        try:
            offered = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            offered = ""
    return hmac.compare_digest(offered.encode(), api_key.encode())


def _unauthorized():
    lines = ["an API key is needed: Authorization: Bearer KEY, or basic auth with the key as the password"]
    return problem_response(401, lines, {"WWW-Authenticate": 'Bearer, Basic realm="tpugen"'})


class Unauthorized(Exception):
    """No API key, or another one."""


def build_app(service: Service, api_key: str | None) -> FastAPI:
    """The app: routers for the A1111 API, the OpenAI images API, tpugen runs and operations."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio.to_thread

        # Each request waits for its images in a worker thread: room for every request the queue takes.
        anyio.to_thread.current_default_thread_limiter().total_tokens = service.serve.max_queue + 16
        service.start()
        yield
        service.stop()

    # /docs (Swagger UI) and /openapi.json are on, behind the key like every route but /healthz and /readyz.
    app = FastAPI(title="tpugen", version=__version__, lifespan=lifespan, redoc_url=None)
    app.state.service = service
    secured = [Depends(require_key(api_key))]
    app.include_router(ops.router)
    app.include_router(ops.metrics_router, dependencies=secured)
    app.include_router(a1111.router, dependencies=secured)
    app.include_router(a1111.internal_router, dependencies=secured)
    app.include_router(openai_api.router, dependencies=secured)
    app.include_router(runs_api.router, dependencies=secured)
    app.include_router(page.router)
    app.include_router(page.api_router, dependencies=secured)

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
        if isinstance(exc, RecursionError):  # json or YAML nested thousands deep
            return problem_response(422, ["body: nested too deeply to read"])
        return problem_response(500, [one_line(exc)])

    app.add_exception_handler(Exception, lambda request, exc: unforeseen(exc))

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
        elif int(request.headers.get("content-length") or 0) > body_limit(path):
            response = problem_response(413, [too_large(body_limit(path))])
        else:
            try:
                response = await call_next(request)
            except Exception as exc:  # what no handler answered: counted here, or a 5xx would go unseen
                response = unforeseen(exc)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", None) or "unknown"
        service.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
        return response

    # Added last, so outermost: every response, the guard's and the error handlers' included, carries the id.
    app.add_middleware(RequestIds)
    return app
