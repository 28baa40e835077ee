"""The HTTP connections of a front end: uvicorn's httptools protocol, bounded (headers whole within
--header-timeout, at most --max-header-bytes)."""
from __future__ import annotations

import json


def protocol_class(cfg):
    """uvicorn's httptools protocol, bounded: a request's headers must arrive whole within
    --header-timeout (a socket that sends nothing is closed then: idle sockets cannot starve the
    server) and be at most --max-header-bytes (431). uvicorn's own keep-alive timeout still closes
    idle keep-alive connections."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    limit, timeout = cfg.max_header_bytes, cfg.header_timeout

    class BoundedProtocol(HttpToolsProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_bytes, self._rejected = 0, False
            self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def on_message_begin(self):
            super().on_message_begin()
            self._header_bytes = 0
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def on_url(self, url):
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name, value):
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self):
            self._cancel_timer()
            super().on_headers_complete()

        def connection_lost(self, exc):
            self._cancel_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg):
            if not self._rejected:  # after our own 431/408 the parser's error is moot
                super().send_400_response(msg)

        def _cancel_timer(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _count(self, n):
            self._header_bytes += n
            if self._header_bytes > limit and not self._rejected:
                self._reject(431, f"request headers over the limit of {limit} bytes (--max-header-bytes)")
                raise ValueError("headers too large")  # stops the parser (caught by data_received)

        def _headers_late(self):
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self._reject(408, f"request headers not received within {timeout:g} s (--header-timeout)")

        def _reject(self, status, detail):
            self._rejected = True
            body = json.dumps({"detail": detail}).encode()
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status, reason, len(body), body))
            self.transport.close()

    return BoundedProtocol
