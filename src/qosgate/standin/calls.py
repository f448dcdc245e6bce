"""How the stand-in serves one request: the engine call (``StandInCall``, with no scheduler above
the engine) and the client's response (``StandInSink``), which the ``hang-mid-stream`` fault cuts
short."""

from __future__ import annotations

import asyncio

from qosgate.core.facts import AttemptFailed
from qosgate.runtime.ports import Sink
from qosgate.server.asgi import Send
from qosgate.wire.engine_request import EngineRequest
from qosgate.wire.resume import Transcript
from qosgate.wire.sse import EVENT_END


class StandInCall:
    """The stand-in serves a request directly: no scheduler above the engine."""

    __slots__ = ("engine_request", "finished", "sink", "success")
    transcript: Transcript | None = None  # (the engine's own answer: nothing continues it)

    def __init__(
        self, engine_request: EngineRequest, sink: Sink, finished: dict[str, int],
        success: dict[str, int],
    ) -> None:
        self.engine_request = engine_request
        self.sink = sink
        self.finished = finished
        self.success = success

    def order(self) -> int:
        return 0

    def levels(self) -> int:
        return 1

    def level(self) -> int:
        return 0

    def progress(self, tokens: int) -> None:
        pass

    def output_cap(self) -> int:
        return self.engine_request.max_tokens or 0

    def token_s(self) -> float | None:
        return None

    def first_token(self) -> None:
        pass

    def done(self, output_tokens: int, prompt_tokens: int | None = None,
             cached_tokens: int | None = None) -> None:
        cap = self.engine_request.max_tokens
        reason = "length" if cap is not None and output_tokens >= cap else "stop"
        self.finished[reason] += 1
        self.success[reason] += 1

    def failed(self, reason: str, output_tokens: int = 0) -> None:
        pass

    def attempt_failed(self, fact: AttemptFailed) -> None:
        pass

    def timed_out(self, reason: str) -> None:
        pass

    def refused(self, status: int, body: bytes) -> None:
        pass

    def moved(self, fact: AttemptFailed) -> None:
        pass

    def unresumable(self) -> None:
        pass

    def continued(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        pass


class StandInSink:
    """The client's response; with ``stall_after``, the ``hang-mid-stream`` fault."""

    __slots__ = ("_send", "complete", "stall_after", "started", "stream")

    def __init__(self, send: Send, stall_after: int | None = None, stream: bool = True) -> None:
        self._send = send
        self.started = False
        self.complete = False
        # fault hang-mid-stream: content chunks still to send before the stream hangs
        self.stall_after = stall_after
        self.stream = stream

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.stall_after is not None and not self.stream:
            await _hang()  # a whole answer is its own first byte: it never comes
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def send(self, data: bytes, more: bool = True) -> None:
        left = self.stall_after
        if left is not None and self.stream:
            data, left, stop = cut_stream(data, left)
            self.stall_after = left
            if stop:
                if data:
                    await self._send({"type": "http.response.body", "body": data,
                                      "more_body": True})
                await _hang()
        if not more:
            self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


async def _hang() -> None:
    """Never return (the request's task is cancelled when its client leaves)."""
    await asyncio.get_running_loop().create_future()


def cut_stream(data: bytes, left: int) -> tuple[bytes, int, bool]:
    """Keep the SSE events of ``data`` up to ``left`` content chunks (the role chunk is free):
    (what to send, chunks left, stop after it)."""
    events = data.split(EVENT_END)
    kept: list[bytes] = []
    for ev in events[:-1]:  # the last element is what follows the final separator (b"")
        if b'"role":' not in ev:
            if left <= 0:
                return b"".join(e + EVENT_END for e in kept), 0, True
            left -= 1
        kept.append(ev)
    return data, left, False

