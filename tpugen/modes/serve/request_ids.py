"""Who sent the request being served, and its id: `X-Request-Id` echoed (or made) on every response."""

from __future__ import annotations

import base64
import hashlib
import re
import uuid
from contextvars import ContextVar
from dataclasses import dataclass

from tpugen.logs import logger

log = logger("serve")

# Ids a client may choose: what request ids (UUIDs, ULIDs, trace ids) and client names look like, and nothing
# that could break a log line or a header.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# A web UI task id (txt2img's force_task_id): the web UI's own look like task(abc123).
TASK_ID = re.compile(r"[A-Za-z0-9._:()-]{1,128}")


@dataclass(frozen=True)
class Caller:
    """The HTTP request being served: its id and the client it counts for when clients take turns."""

    request_id: str
    client: str


CALLER: ContextVar[Caller | None] = ContextVar("tpugen_caller", default=None)


def current_caller() -> Caller:
    """The request being served in this context (worker threads of a route inherit it); outside any, a made id."""
    return CALLER.get() or Caller(new_id(), "")


def new_id() -> str:
    return uuid.uuid4().hex


def request_id_for(given: str | None) -> str:
    """The client's X-Request-Id when it is a sane one (up to 128 letters, digits and . _ : -), else a new one."""
    return given if given is not None and SAFE_ID.fullmatch(given) else new_id()


def client_of(authorization: str | None, peer: str | None) -> str:
    """Whom a request counts for when clients take turns: its peer address, with the API key it carries (by a
    digest, never the key) when it carries one. Nothing a client merely claims (a header of its choosing) makes
    it another client: it would win itself as many turns as it likes."""
    key = offered_key(authorization or "")
    who = f"peer {peer or '-'}"
    return f"key {hashlib.sha256(key.encode()).hexdigest()[:12]} {who}" if key else who


def offered_key(header: str) -> str:
    """The key in `Authorization: Bearer KEY` (OpenAI clients), or the password of basic auth (A1111 clients'
    --api-auth); "" if neither. The one reading of the header: the key check and the client's identity."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return ""
    return ""


class RequestIds:
    """ASGI middleware, outermost: every response carries `X-Request-Id`; the route sees the request's Caller
    (CALLER); a response of 500 or 504 is a log line naming the id (503s, a busy or draining server's expected
    answer, are not)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        peer = (scope.get("client") or (None,))[0]
        caller = Caller(
            request_id_for(headers.get("x-request-id")),
            client_of(headers.get("authorization"), peer),
        )
        token = CALLER.set(caller)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers") or () if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, (b"x-request-id", caller.request_id.encode())]}
                if message["status"] in (500, 504):
                    # The route's template, not the path sent: nothing a client wrote reaches the log but a sane id.
                    route = getattr(scope.get("route"), "path", None) or "an unknown endpoint"
                    log.warning(f"request {caller.request_id}: {scope['method']} {route} answered {message['status']}")
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CALLER.reset(token)
