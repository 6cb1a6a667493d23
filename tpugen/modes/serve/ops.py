"""Operations: is the process alive, is it ready for requests, and its metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

router = APIRouter()
metrics_router = APIRouter()


@router.get("/healthz")
def healthz() -> dict:
    """The process answers (warming, ready or draining alike)."""
    return {"status": "alive"}


@router.get("/readyz")
def readyz(request: Request):
    """200 once every warm shape key is compiled; 503 while warming, after a failed warmup, or draining."""
    service = request.app.state.service
    body = {"status": service.state, "warm": service.warm_summary()}
    if service.failure:
        body["error"] = service.failure
    return JSONResponse(body, status_code=200 if service.state == "ready" else 503)


@metrics_router.get("/metrics")
def metrics(request: Request) -> Response:
    """The Prometheus text format."""
    data, content_type = request.app.state.service.metrics.exposition()
    return Response(data, media_type=content_type)
