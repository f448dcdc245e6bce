"""The request log (``request_log`` in the config): one JSON line per request that ended, so
that an operator can say why a request was refused or failed and match it, by its id, with the
client's ``x-qosgate-request-id`` and the engine's own log (``X-Request-Id``).

The flow calls it once per request, where the request's one outcome is known (``RequestFlow``):
``ended`` for a request the scheduler had, ``refused`` for one that ended before it. Which of them
get a line is ``request_line.wanted``: refusals and failures by default, the rest sampled.

A line is one ``write`` on the destination: a file is opened for appending, unbuffered, so that
the processes of ``serve --workers`` appending to one file never split each other's lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import BinaryIO

from qosgate.core import Request
from qosgate.server.request_line import RequestLine, core_line, encoded, gateway_line, wanted
from qosgate.settings import RequestLogSettings

Write = Callable[[bytes], None]  # one line, newline included

_STREAMS = {"stderr": "stderr", "stdout": "stdout", "-": "stdout"}


class _FileLines:
    """Lines appended to a file, opened at the first line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: BinaryIO | None = None

    def __call__(self, data: bytes) -> None:
        f = self.file
        if f is None:
            f = self.file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open
        f.write(data)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _stream_lines(name: str) -> Write:
    """Lines to ``sys.stderr`` or ``sys.stdout`` as they are when each is written (so that a
    redirection made later, a test's capture, is followed)."""

    def write(data: bytes) -> None:
        stream = getattr(sys, name)
        stream.write(data.decode())
        stream.flush()

    return write


class RequestLog:
    """Writes the line of each request that ended, if it is wanted (``request_line.wanted``)."""

    def __init__(self, settings: RequestLogSettings, write: Write | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.enabled = settings.enabled
        self.errors = settings.errors
        self.sample = settings.sample
        self._file: _FileLines | None = None
        if write is None:
            stream = _STREAMS.get(settings.path)
            if stream is None:
                write = self._file = _FileLines(settings.path)
            else:
                write = _stream_lines(stream)
        self._write = write
        self._wall = wall

    def ended(self, req: Request, route: str | None, status: int | None,
              client_id: str | None = None) -> None:
        """A request the scheduler had reached its terminal state; its client got ``status``."""
        if self.enabled and wanted(req.id, req.state.value, req.reason, self.errors, self.sample):
            self._put(core_line(req, route, status, self._wall(), client_id))

    def refused(self, rid: str, tenant: str, service_class: str, route: str | None,
                reason: str, status: int | None, duration_s: float,
                client_id: str | None = None, outcome: str = "rejected") -> None:
        """A request that ended before it reached the scheduler (refused, or its client left
        while sending it: ``outcome`` cancelled)."""
        if self.enabled and wanted(rid, outcome, reason, self.errors, self.sample):
            self._put(gateway_line(rid, tenant, service_class, route, outcome, reason, status,
                                   duration_s, self._wall(), client_id))

    def _put(self, line: RequestLine) -> None:
        self._write(encoded(line) + b"\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
