"""Operations: is the process alive, is it ready for requests, and its metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

router = APIRouter()
metrics_router = APIRouter()


@router.get("/healthz")
def healthz() -> dict:
    """The process answers: from its first second (the socket is bound before the model loads), whether it is
    loading, compiling, ready, draining or failed."""
    return {"status": "alive"}


@router.get("/readyz")
def readyz(request: Request):
    """200 once every warm shape key is compiled; 503 until then, saying what the server is doing (`loading`,
    `compiling` with `detail`: compiling 3 of 8 shape keys), while `draining`, or once `failed` (its `error`)."""
    service = request.app.state.service
    return JSONResponse(service.readiness(), status_code=200 if service.state == "ready" else 503)


@metrics_router.get("/metrics")
def metrics(request: Request) -> Response:
    """The Prometheus text format."""
    data, content_type = request.app.state.service.metrics.exposition()
    return Response(data, media_type=content_type)
