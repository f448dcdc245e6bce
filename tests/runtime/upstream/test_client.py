"""The upstream engine's own HTTP/1.1 client, against a scripted server: framing (chunked,
Content-Length, end of connection), keep-alive reuse, the one retry on a stale kept-alive
connection, errors, and what ``OpenAIUpstream.run`` hands the sink and the call."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import fields

import pytest

from qosgate.core.facts import AttemptFailed
from qosgate.runtime.upstream.replica import OpenAIUpstream
from qosgate.runtime.upstream.transport import Pool, UpstreamError
from qosgate.settings import UpstreamSettings
from qosgate.wire.engine_request import EngineRequest
from qosgate.wire.resume import Transcript

Script = Callable[["Scripted", asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return head + body


class Scripted:
    """A server whose n-th connection is handled by ``script(reader, writer, n)``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof_seen = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Scripted:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = self.connections
            self.connections += 1
            try:
                await self.script(self, reader, writer, n)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE = [
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]


async def _sse_response(writer: asyncio.StreamWriter) -> None:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    # the head split mid-line, then events one by one (as an engine writes them) and the end
    writer.write(head[:20])
    await writer.drain()
    await asyncio.sleep(0.01)
    writer.write(head[20:])
    for ev in SSE:
        await asyncio.sleep(0.005)
        writer.write(_chunk(ev))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the pool
def test_chunked_and_content_length_bodies_on_one_kept_alive_connection() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        srv.requests.append(await _read_request(reader))
        await _sse_response(writer)
        srv.requests.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 11\r\n\r\n{\"ok\":true}")
        await writer.drain()
        await reader.read()  # until the client closes

    async def main() -> None:
        async with Scripted(script) as s:
            pool = Pool(s.url, 2.0, "sk-up")
            conn = await pool.request(pool.head("POST", "/v1/chat/completions"), b'{"a":1}')
            assert conn.status == 200 and conn.content_type == b"text/event-stream"
            got = []
            while chunk := await conn.read_some():
                got.append(chunk)
            assert b"".join(got) == b"".join(SSE)
            assert len(got) >= 3  # handed on as it arrived, not at the end
            pool.release(conn)
            conn2 = await pool.request(pool.head("POST", "/v1/completions"), b"{}")
            assert conn2 is conn and await conn2.read_all() == b'{"ok":true}'
            pool.release(conn2)
            assert s.connections == 1
            first = s.requests[0]
            assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"Authorization: Bearer sk-up\r\n" in first
            assert b"Content-Length: 7\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')
            pool.close()

    run(main())


def test_body_delimited_by_the_end_of_the_connection() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"world")
        await writer.drain()

    async def main() -> None:
        async with Scripted(script) as s:
            pool = Pool(s.url, 2.0, None)
            conn = await pool.request(pool.head("GET", "/x", json_body=False), b"")
            assert await conn.read_all() == b"hello world"
            pool.release(conn)
            assert pool.idle == []  # not reusable

    run(main())


def test_a_stale_kept_alive_connection_is_retried_once_on_a_new_one() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if n == 0:  # the next request on it crosses the server's keep-alive close: no answer
            await _read_request(reader)

    async def main() -> None:
        async with Scripted(script) as s:
            pool = Pool(s.url, 2.0, None)
            head = pool.head("POST", "/v1/completions")
            conn = await pool.request(head, b"{}")
            assert await conn.read_all() == b"ok"
            pool.release(conn)
            conn2 = await pool.request(head, b"{}")
            assert await conn2.read_all() == b"ok"
            assert conn2 is not conn and s.connections == 2
            pool.close()

    run(main())


def test_a_connection_broken_mid_body_fails_without_retry() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"data: x"))
        await writer.drain()

    async def main() -> None:
        async with Scripted(script) as s:
            pool = Pool(s.url, 2.0, None)
            conn = await pool.request(pool.head("POST", "/v1/completions"), b"{}")
            assert await conn.read_some() == b"data: x"
            with pytest.raises(UpstreamError):
                await conn.read_some()
            assert s.connections == 1

    run(main())


def test_unreachable_upstream_raises_an_oserror() -> None:
    async def main() -> None:
        pool = Pool("http://127.0.0.1:9", 1.0, None)  # discard port: nothing listens
        with pytest.raises(OSError):
            await pool.request(pool.head("POST", "/v1/completions"), b"{}")

    run(main())


# ---------------------------------------------------------------------- the engine call
class FakeSink:
    def __init__(self) -> None:
        self.started = False
        self.complete = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.sends: list[tuple[bytes, bool]] = []

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        self.headers = headers

    async def send(self, data: bytes, more: bool = True) -> None:
        self.sends.append((data, more))
        self.complete = not more


class FakeCall:
    def __init__(self, stream: bool, body: bytes = b'{"model":"m","stream":true}') -> None:
        self.engine_request = EngineRequest(rid="r1", route="chat", body=body, stream=stream,
                       model="m", max_tokens=5, prompt_tokens=3)
        self.first_tokens = 0
        self.sink = FakeSink()
        self.outcome: tuple[str, object] | None = None

    def order(self) -> int:
        return 1  # an order value (core.queueing.engine_order), sent as it is in vLLM's polarity

    def levels(self) -> int:
        return 4

    def progress(self, tokens: int) -> None:
        self.streamed = tokens

    measured_token_s: float | None = None  # what the core measured on the replica

    def output_cap(self) -> int:
        return 5

    def token_s(self) -> float | None:
        return self.measured_token_s

    def first_token(self) -> None:
        self.first_tokens += 1

    def done(self, output_tokens: int, prompt_tokens: int | None = None,
             cached_tokens: int | None = None) -> None:
        self.outcome = ("done", (output_tokens, prompt_tokens))
        self.cached_tokens = cached_tokens

    def failed(self, reason: str, output_tokens: int = 0) -> None:
        self.outcome = ("failed", reason)

    def attempt_failed(self, fact: AttemptFailed) -> None:
        # as (reason, what differs from a plain failure)
        how = {f.name: getattr(fact, f.name) for f in fields(fact)[1:]
               if getattr(fact, f.name) != f.default}
        self.outcome = ("attempt_failed", (fact.reason, how))

    def timed_out(self, reason: str) -> None:
        self.outcome = ("timed_out", reason)

    def refused(self, status: int, body: bytes) -> None:
        self.outcome = ("refused", (status, body))

    transcript: Transcript | None = None

    def moved(self, fact: AttemptFailed) -> None:
        self.outcome = ("moved", fact.reason)

    def unresumable(self) -> None:
        self.outcome = ("unresumable", None)

    def continued(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        pass


def _engine(url: str) -> OpenAIUpstream:
    return OpenAIUpstream(UpstreamSettings(url=url, priority_polarity="vllm", models=("m",)))


def test_run_streams_every_byte_and_reports_the_usage() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        srv.requests.append(await _read_request(reader))
        await _sse_response(writer)
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            call = FakeCall(stream=True)
            await eng.run(call)
            sink = call.sink
            assert sink.status == 200
            assert sink.headers == [(b"content-type", b"text/event-stream"),
                                    (b"cache-control", b"no-cache")]
            assert b"".join(d for d, _ in sink.sends) == b"".join(SSE)
            assert [more for _, more in sink.sends][-1] is False
            assert all(more for _, more in sink.sends[:-1])
            assert call.outcome == ("done", (2, 7))
            assert s.requests[0].endswith(b'\r\n\r\n{"priority":1,"model":"m","stream":true}')
            assert len(eng._pool.idle) == 1  # kept alive for the next call
            await eng.close()

    run(main())


def test_run_passes_an_engine_error_through() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        body = b'{"error":{"message":"nope"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            call = FakeCall(stream=True)
            await eng.run(call)
            # handed to the core as a refusal (the request ends rejected), the body passed on
            assert not call.sink.started
            assert call.outcome == ("refused", (400, b'{"error":{"message":"nope"}}'))
            await eng.close()

    run(main())


WHOLE = (b'{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":'
         b'{"role":"assistant","content":"ab"},"finish_reason":"length"}],'
         b'"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}')


def test_a_whole_answer_is_asked_as_sent_and_passed_on_as_the_engine_sent_it() -> None:
    """A client that did not ask for a stream is not sent one: vLLM serves some features only
    whole (``prompt_logprobs``, beam search), so the body goes as the client wrote it, with
    qosgate's ``priority`` the one member set."""
    sent = b'{"model":"m","prompt_logprobs":1,"messages":[{"role":"user","content":"hi"}]}'

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        srv.requests.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(WHOLE), WHOLE))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            call = FakeCall(stream=False, body=sent)
            await eng.run(call)
            body = s.requests[0].split(b"\r\n\r\n", 1)[1]
            assert json.loads(body) == {**json.loads(sent), "priority": 1}
            assert b'"stream' not in body
            sink = call.sink
            assert sink.status == 200
            assert sink.headers == [(b"content-type", b"application/json")]
            assert sink.sends == [(WHOLE, False)]  # once, whole, byte for byte
            assert call.first_tokens == 1  # its first byte: the whole answer
            assert call.outcome == ("done", (2, 7))
            assert len(eng._pool.idle) == 1
            await eng.close()

    run(main())


def test_a_whole_answer_is_bounded_by_its_output_cap_at_the_measured_time_per_token() -> None:
    """An engine that took the request and never answers: the bound on a whole answer is the
    first byte's plus its output cap at the margin times the replica's measured time per
    token (``core/progress.py``); then the attempt fails, for the core to retry elsewhere."""

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        srv.requests.append(await _read_request(reader))
        assert await reader.read() == b""  # silence until the gateway gives up and closes
        srv.eof_seen.set()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = OpenAIUpstream(UpstreamSettings(url=s.url, models=("m",),
                                                  whole_answer_margin=2.0))
            call = FakeCall(stream=False, body=b'{"model":"m"}')
            call.engine_request.first_byte_timeout_s = 0.1
            call.measured_token_s = 0.05  # cap 5: 0.1 + 2 x 5 x 0.05 = 0.6 s
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.create_task(eng.run(call)), 10)
            assert call.outcome == ("attempt_failed", ("first_byte_timeout", {}))
            assert time.monotonic() - t0 >= 0.6
            assert not call.sink.started
            await asyncio.wait_for(s.eof_seen.wait(), 2)
            await eng.close()

    run(main())


def _metrics(tokens: int) -> bytes:
    return (b"# TYPE vllm:generation_tokens_total counter\n"
            b'vllm:generation_tokens_total{model_name="m"} %d\n'
            b"vllm:num_requests_running 1\n" % tokens)


def test_an_engine_whose_token_counters_stand_still_while_it_holds_work_is_stalled() -> None:
    """It answers its probes but produces no token: stalled once ``stall_s`` passed, so it is
    reported down (no new requests) and the call sent to it, not begun, fails as an attempt
    (``engine_stalled``) for the core to retry elsewhere. Once it holds nothing, it is judged
    up again; an engine whose counters move is never stalled."""
    moving = [False]
    tokens = [100]

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        while True:
            req = await _read_request(reader)
            if req.startswith(b"GET /v1/models"):
                body = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
            elif req.startswith(b"GET /metrics"):
                tokens[0] += 1 if moving[0] else 0
                body = _metrics(tokens[0])
            else:  # a generation: taken, never answered
                srv.requests.append(req)
                assert await reader.read() == b""
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = OpenAIUpstream(UpstreamSettings(url=s.url, models=("m",), stall_s=0.2))
            assert (await eng.probe()).up  # idle: not judged
            call = FakeCall(stream=False, body=b'{"model":"m"}')
            call.engine_request.first_byte_timeout_s = 60.0
            task = asyncio.create_task(eng.run(call))
            while not s.requests:
                await asyncio.sleep(0.01)
            moving[0] = True
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.5:  # progress: never stalled
                assert (await eng.probe()).up
                await asyncio.sleep(0.02)
            moving[0] = False
            ups = []
            while not task.done():
                ups.append((await eng.probe()).up)
                await asyncio.sleep(0.02)
            assert False in ups and call.outcome == ("attempt_failed", ("engine_stalled", {}))
            assert (await eng.probe()).up  # it holds nothing now
            await eng.close()

    run(main())


def test_cancelling_a_call_closes_its_upstream_connection() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(SSE[0]))
        await writer.drain()
        assert await reader.read() == b""  # EOF: the gateway hung up, the engine aborts
        srv.eof_seen.set()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            call = FakeCall(stream=True)
            task = asyncio.create_task(eng.run(call))
            while not call.sink.sends:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(s.eof_seen.wait(), 2)
            assert eng._pool.idle == []
            await eng.close()

    run(main())


def test_unreachable_engine_is_a_failed_attempt_that_marks_it_down() -> None:
    async def main() -> None:
        eng = _engine("http://127.0.0.1:9")
        call = FakeCall(stream=False)
        await eng.run(call)
        assert call.outcome == ("attempt_failed", ("upstream_unreachable",
                                                   {"unreachable": True}))
        assert not call.sink.started

    run(main())


class SlowSink(FakeSink):
    """A client that reads slowly: chosen sink calls wait (as the ASGI server's flow control
    makes them) until the gate opens."""

    def __init__(self, stall_start: bool, stall_send: int | None) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.stalled = asyncio.Event()  # set once a call waits at the gate
        self.stall_start = stall_start
        self.stall_send = stall_send
        self.stalls = 0

    async def _stall(self) -> None:
        self.stalls += 1
        self.stalled.set()
        await self.gate.wait()

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.stall_start:
            await self._stall()
        await super().start(status, headers)

    async def send(self, data: bytes, more: bool = True) -> None:
        if len(self.sends) == self.stall_send:
            await self._stall()
        await super().send(data, more)


@pytest.mark.parametrize(("stall_start", "stall_send"), [(True, None), (False, 1), (False, 3)])
def test_a_slow_client_gets_every_byte_in_order(stall_start: bool, stall_send: int | None) -> None:
    sent_all = asyncio.Event()

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        await _sse_response(writer)
        sent_all.set()
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            call = FakeCall(stream=True)
            sink = SlowSink(stall_start, stall_send)
            call.sink = sink
            task = asyncio.create_task(eng.run(call))
            # the engine has sent everything while the client stalls (waited for, not slept
            # on: a fixed 80 ms lost that race on a loaded machine now and then)
            await asyncio.wait_for(asyncio.gather(sent_all.wait(), sink.stalled.wait()), 10)
            assert sink.stalls == 1 and not task.done()
            sink.gate.set()
            await asyncio.wait_for(task, 2)
            assert b"".join(d for d, _ in sink.sends) == b"".join(SSE)
            assert [more for _, more in sink.sends][-1] is False
            assert all(more for _, more in sink.sends[:-1])
            assert sink.headers[0] == (b"content-type", b"text/event-stream")
            assert call.outcome == ("done", (2, 7))
            await eng.close()

    run(main())


def test_nothing_is_relayed_once_the_call_is_pulled_back() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for ev in SSE:
            await asyncio.sleep(0.01)
            writer.write(_chunk(ev))
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            call = FakeCall(stream=True)
            task = asyncio.create_task(eng.run(call))
            while not call.sink.sends:
                await asyncio.sleep(0.002)
            task.cancel()  # the relay sees it at once, before the task runs again
            n = len(call.sink.sends)
            await asyncio.sleep(0.06)
            assert len(call.sink.sends) == n
            assert task.cancelled()
            await eng.close()

    run(main())


def test_a_stream_on_a_stale_kept_alive_connection_is_retried_once() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        await _sse_response(writer)
        if n == 0:  # closed by its keep-alive timeout as the next request arrives
            await _read_request(reader)
            return
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            for _ in range(2):
                call = FakeCall(stream=True)
                await eng.run(call)
                assert call.outcome == ("done", (2, 7))
                assert b"".join(d for d, _ in call.sink.sends) == b"".join(SSE)
            assert s.connections == 2
            await eng.close()

    run(main())


def test_start_call_writes_at_once_and_a_cancel_before_its_task_ran_aborts() -> None:
    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        await _sse_response(writer)
        srv.requests.append(await _read_request(reader))  # written by start_call itself
        assert await reader.read() == b""  # then the connection is closed: the engine aborts
        srv.eof_seen.set()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            first = FakeCall(stream=True)
            await asyncio.create_task(eng.start_call(first))  # no free connection: a new one
            assert first.outcome == ("done", (2, 7)) and len(eng._pool.idle) == 1
            call = FakeCall(stream=True)
            task = asyncio.create_task(eng.start_call(call))
            assert eng._pool.idle == []  # taken, the request written: before the task runs
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(s.eof_seen.wait(), 2)
            assert len(s.requests) == 1 and call.outcome is None and not call.sink.sends
            await eng.close()

    run(main())


def test_a_first_byte_timeout_of_an_eager_call_ends_that_call_not_its_dispatcher() -> None:
    """``start_call`` runs the call up to its first suspension in the dispatching task (the
    client's request handler): the watchdog must cancel the call's own task, not that one."""

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        await _sse_response(writer)
        srv.requests.append(await _read_request(reader))  # then silence: a hung engine
        assert await reader.read() == b""  # until the gateway gives up and closes
        srv.eof_seen.set()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = _engine(s.url)
            await asyncio.create_task(eng.start_call(FakeCall(stream=True)))
            call = FakeCall(stream=True)
            call.engine_request.first_byte_timeout_s = 0.2
            task = asyncio.create_task(eng.start_call(call))
            assert eng._pool.idle == []  # written eagerly on the kept-alive connection
            await asyncio.sleep(0.5)  # this (dispatching) task is not the one cancelled
            await task
            assert call.outcome == ("attempt_failed", ("first_byte_timeout", {}))
            await asyncio.wait_for(s.eof_seen.wait(), 2)
            await eng.close()

    run(main())


def test_a_stream_that_stalls_after_its_first_byte_ends_at_the_idle_bound() -> None:
    """The idle bound holds from the first byte on, even when the first-byte bound (the timer
    armed at the start) is much further off."""

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" + _chunk(SSE[0]) + _chunk(SSE[1]))
        await writer.drain()
        assert await reader.read() == b""  # silence until the gateway gives up and closes
        srv.eof_seen.set()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = OpenAIUpstream(UpstreamSettings(url=s.url, models=("m",), idle_timeout_s=0.3))
            call = FakeCall(stream=True)
            call.engine_request.first_byte_timeout_s = 30.0
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.create_task(eng.run(call)), 5)
            assert call.outcome == ("timed_out", "idle_timeout")
            assert 0.3 <= time.monotonic() - t0 < 2.0
            assert call.sink.started
            await asyncio.wait_for(s.eof_seen.wait(), 2)
            await eng.close()

    run(main())


def test_a_large_body_is_sent_whole() -> None:
    body = b'{"messages":"' + b"x" * 300_000 + b'"}'

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        srv.requests.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            pool = Pool(s.url, 2.0, None)
            conn = await pool.request(pool.head("POST", "/v1/completions"), body)
            assert await conn.read_all() == b"ok"
            assert s.requests[0].endswith(b"\r\n\r\n" + body)
            pool.close()

    run(main())


def test_every_call_names_its_request_to_the_engine_with_x_request_id() -> None:
    """The gateway's request id reaches the engine (vLLM takes it as its own: ``chatcmpl-<id>``
    in its log), whether the call waits for a connection (``run``) or is written at once on a
    kept-alive one (``start_call``)."""

    async def script(srv: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     n: int) -> None:
        for _ in range(2):
            srv.requests.append(await _read_request(reader))
            await _sse_response(writer)
        await reader.read()

    async def main() -> None:
        async with Scripted(script) as s:
            eng = OpenAIUpstream(UpstreamSettings(url=s.url, models=("m",), api_key="sk-up"))
            first = FakeCall(stream=True)
            await eng.run(first)
            second = FakeCall(stream=True)
            second.engine_request = EngineRequest(
                rid="5eed-2", route="chat", body=b'{"model":"m","stream":true}', stream=True,
                model="m", max_tokens=5, prompt_tokens=3)
            await asyncio.create_task(eng.start_call(second))  # on the kept-alive connection
            assert first.outcome == second.outcome == ("done", (2, 7))
            heads = [r.split(b"\r\n\r\n", 1)[0].split(b"\r\n") for r in s.requests]
            assert heads[0][0] == b"POST /v1/chat/completions HTTP/1.1"
            assert b"X-Request-Id: r1" in heads[0] and b"X-Request-Id: 5eed-2" in heads[1]
            for head in heads:  # the rest of the head as before
                assert b"Authorization: Bearer sk-up" in head
                assert [h for h in head if h.startswith(b"Content-Length: ")] == [
                    b"Content-Length: %d" % len(b'{"model":"m","stream":true}')]
            await eng.close()

    run(main())
