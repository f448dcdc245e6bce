"""The measuring client against canned answers from an in-process socket server: which chunks
are tokens, the usage, and the outcome of a refusal."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from qosgate.measure import Answer, send
from qosgate.runtime.upstream.transport import Pool


def _sse(*docs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs) + (
        b"data: [DONE]\n\n")


def _answer(status: int, body: bytes, extra: str = "") -> Answer:
    """Serve one response of ``status`` and ``body`` and measure it, on a clock that ticks once
    a reading."""
    ticks = iter(range(1000))

    async def main() -> Answer:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readuntil(b"\r\n\r\n")
            w.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}"
                    "Connection: close\r\n\r\n".encode() + body)
            await w.drain()
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}", connect_timeout_s=5.0, api_key=None)
        ans = Answer()
        await send(pool, pool.head("POST", "/v1/completions"), b"{}", 0.0, ans,
                   clock=lambda: float(next(ticks)))
        pool.close()
        server.close()
        await server.wait_closed()
        return ans

    return asyncio.run(main())


def _choice(**kw: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": None, **kw}]}


def test_a_completions_stream_counts_its_tokens_not_its_closing_chunk() -> None:
    """A token may decode to no text; the textless chunk that only closes the stream is none."""
    body = _sse(_choice(text="a"), _choice(text=""), _choice(text="b"),
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    ans = _answer(200, body)
    assert (ans.state, ans.reason) == ("completed", "completed")
    assert len(ans.chunk_times) == 3 and ans.first_token_at == ans.chunk_times[0]
    assert (ans.prompt_tokens, ans.output_tokens) == (5, 3)


def test_a_chat_stream_skips_its_role_event_and_its_closing_delta() -> None:
    body = _sse(_choice(delta={"role": "assistant", "content": ""}),
                _choice(delta={"content": "hi"}), _choice(delta={"content": " there"}),
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    ans = _answer(200, body)
    assert len(ans.chunk_times) == 2
    assert ans.output_tokens == 2  # no usage: the token chunks counted


def test_a_refusal_is_rejected_with_its_code_param_and_retry_after() -> None:
    err = {"error": {"code": "queue_full", "param": "x-qos-class", "message": "full"}}
    ans = _answer(429, json.dumps(err).encode(), "Retry-After: 2\r\n")
    assert (ans.status, ans.state, ans.reason) == (429, "rejected", "queue_full")
    assert (ans.param, ans.retry_after) == ("x-qos-class", 2.0)
    assert "queue_full" in ans.detail and not ans.chunk_times


def test_an_error_event_mid_stream_ends_the_request_with_its_code() -> None:
    body = _sse(_choice(text="a"), {"error": {"code": "idle_timeout", "message": "late"}})
    ans = _answer(200, body)
    assert (ans.state, ans.reason) == ("timed_out", "idle_timeout")
    assert len(ans.chunk_times) == 1
