"""Connections that would hold the server without asking it anything: closed after a deadline.

uvicorn closes a connection left idle after an answer (serve.idle_timeout_s, its keep-alive timeout), but not
one that is opened and never speaks, nor one that sends half a request head and stops: each holds a socket and
a file descriptor for as long as its client likes. The protocol made here gives a request's head
serve.read_timeout_s to arrive, counted from the connection's first moment or from the first byte after an
answer, then closes the connection. A body that stops half-way is the ASGI layer's to answer (http.Guarded: 408).
"""

from __future__ import annotations

import asyncio


def protocol_with_deadline(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11), with a deadline on every request head."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_head()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            # No request in hand: none yet, or the last one answered (bytes since are the next one's head).
            return self.cycle is None or self.cycle.response_complete

        def _watch_head(self) -> None:
            if not self._waiting_for_head():
                self._disarm()
            elif self._head_timer is None and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(read_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline
