"""The server's page for people (GET /): one HTML file, its CSS and its JavaScript, shipped in the package."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from tpugen.modes.serve.page.api import router as api_router

__all__ = ["OPEN_PATHS", "api_router", "router"]

# The page's files by the path they are served at, with their media type. They hold no data: they are served
# without the API key (so the page can ask for it), and every call the page makes carries the key.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page/page.css": ("page.css", "text/css; charset=utf-8"),
    "/page/page.js": ("page.js", "text/javascript; charset=utf-8"),
}
OPEN_PATHS = tuple(FILES)

# Nothing but the server itself: no CDN, no inline script, no framing; images come as data: (a request's) or
# blob: URLs (a run's, fetched with the key).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data: blob:; script-src 'self'; style-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter()


def _file(path: str) -> Response:
    name, media_type = FILES[path]
    data = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(data, media_type=media_type, headers=HEADERS)


@router.get("/", include_in_schema=False)
def index() -> Response:
    """The page: make images, watch them being made, browse the runs, the server's status."""
    return _file("/")


@router.get("/page/page.css", include_in_schema=False)
def stylesheet() -> Response:
    return _file("/page/page.css")


@router.get("/page/page.js", include_in_schema=False)
def script() -> Response:
    return _file("/page/page.js")
