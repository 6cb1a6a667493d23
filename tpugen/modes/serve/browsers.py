"""What keeps web pages off the server: the Origin a browser sends, the Host a rebound DNS name brings, and the
headers that keep its replies out of frames and sniffing. Pure rules (tpugen.modes.serve.http applies them)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost",)
# On every reply: no page may frame the server's (clickjacking), and no browser may read a reply as another type.
SECURITY_HEADERS = [(b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff")]


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name of a Host header's value, without its port ("[::1]:7860" -> "::1")."""
    try:
        parts = urlsplit(f"//{host_header}")
        parts.port  # noqa: B018 -- read to raise ValueError for a port that is not a number
        return (parts.hostname or "").lower()
    except ValueError:  # a port that is not a number, an unclosed bracket
        return ""


def host_problem(host_header: str | None, *, loopback_only: bool, allowed: list[str]) -> str | None:
    """Why a request's Host is not this server's, or None: a server bound to loopback answers loopback names and
    `allowed` ones only (a DNS name rebound to 127.0.0.1 brings its own name)."""
    if not loopback_only:
        return None
    name = host_name(host_header or "")
    if is_loopback(name) or name in {a.lower() for a in allowed}:
        return None
    shown = (host_header or "")[:100]
    return (
        f"Host: {shown!r} is not this server's: bound to loopback, it answers localhost, 127.0.0.1 and [::1] "
        "(serve.allowed_hosts adds names)"
    )


def origin_problem(origin: str | None, host_header: str | None, scheme: str, allowed: list[str]) -> str | None:
    """Why a browser's request may not reach the server, or None: its Origin is the server's own (its page),
    one of `allowed`, or absent (not a browser's cross-site request)."""
    if origin is None:
        return None
    if origin == f"{scheme}://{host_header}" or origin in allowed:
        return None
    return f"Origin: {origin[:100]!r} may not call this server (serve.allowed_origins lists the pages that may)"
