"""Hot-path choices, measured: the request parser and the upstream HTTP client.

    .venv/bin/python bench/hotpath.py            # needs orjson and httpx for the comparisons

Parser: time to get the scheduler's fields (model, stream, max_tokens, priority, QoS fields and a
prompt-size estimate) out of a chat body, for a short (~0.6 KB) and a long (~64 KB) conversation
and a question with a 600 KB PNG (0.8 MB of base64, whose size the gateway reads from its header):
``json.loads``, ``orjson.loads``, ``msgspec`` full decode, and the gateway's ``msgspec`` partial
decode into a typed struct with the messages kept as a raw span. Plus the priority splice.

Client: a tiny SSE server (separate process) sends 16 small chunks per request; each client runs
N streaming requests at 64 concurrent and reports requests/s and client CPU per request: the
gateway's own client (an ``asyncio.Protocol`` around httptools), aiohttp and httpx.
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing
import os
import random
import socket
import struct
import time
import timeit
import zlib
from collections.abc import Callable
from typing import Any

import msgspec

from qosgate.wire.parse import estimate_prompt_tokens, parse_body
from qosgate.wire.splice import set_priority


def _body(turns: int) -> bytes:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: " + "lorem ipsum dolor " * 20})
        msgs.append({"role": "assistant", "content": "Answer: " + "sit amet consectetur " * 20})
    return json.dumps({
        "model": "Qwen/Qwen2.5-7B-Instruct", "messages": msgs, "max_tokens": 256,
        "stream": True, "temperature": 0.7, "priority": 1, "task_type": "chat",
    }).encode()


def _png(width: int, height: int) -> bytes:
    """An RGB PNG of seeded noise (incompressible: about 3 bytes a pixel)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    rng = random.Random(0)
    raw = b"".join(b"\x00" + rng.randbytes(width * 3) for _ in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 1))
            + chunk(b"IEND", b""))


def _image_body() -> bytes:
    url = "data:image/png;base64," + base64.b64encode(_png(512, 400)).decode()
    return json.dumps({
        "model": "m", "max_tokens": 256, "stream": True, "priority": 1,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
    }).encode()


def _fields_from_dict(d: dict[str, Any]) -> tuple[Any, ...]:
    size = sum(len(m.get("content") or "") for m in d.get("messages", ()))
    return (d.get("model"), d.get("stream"), d.get("max_tokens"), d.get("priority"),
            d.get("task_type"), size // 4)


class _Partial(msgspec.Struct):
    """The gateway's first reader (before body checks): the scheduler's fields typed, the
    messages a raw span, nothing else checked."""

    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    priority: int | None = None
    task_type: str | None = None
    messages: msgspec.Raw = msgspec.Raw(b"")


_partial = msgspec.json.Decoder(_Partial)


def _fields_from_struct(b: _Partial) -> tuple[Any, ...]:
    return (b.model, b.stream, b.max_tokens, b.priority, b.task_type, len(b.messages) // 4)


def bench_parsers() -> list[tuple[str, str, float]]:
    try:
        import orjson
    except ImportError:  # optional: only for the comparison
        orjson = None

    full = msgspec.json.Decoder()
    rows = []
    for label, body in (("0.6 KB", _body(0) + b""), ("64 KB", _body(75)),
                        ("0.8 MB", _image_body())):
        if label == "0.6 KB":
            body = json.dumps({
                "model": "m", "max_tokens": 256, "stream": True, "priority": 1,
                "messages": [{"role": "system", "content": "You are helpful. " * 4},
                             {"role": "user", "content": "lorem ipsum dolor sit " * 20}],
            }).encode()
        cases: dict[str, Callable[[], object]] = {
            "json.loads": lambda b=body: _fields_from_dict(json.loads(b)),
            "msgspec full": lambda b=body: _fields_from_dict(full.decode(b)),
            "msgspec partial, no checks": lambda b=body: _fields_from_struct(_partial.decode(b)),
            "gateway reader (partial + checks)": (
                lambda b=body: estimate_prompt_tokens(parse_body(b, "chat"))
            ),
        }
        if orjson is not None:
            cases["orjson.loads"] = lambda b=body: _fields_from_dict(orjson.loads(b))
        for name, fn in cases.items():
            n, t = timeit.Timer(fn).autorange()
            rows.append((label, name, t / n * 1e6))
        n, t = timeit.Timer(lambda b=body: set_priority(b, 2, True)).autorange()
        rows.append((label, "priority splice (replace)", t / n * 1e6))
        nb = body.replace(b'"priority": 1, ', b"")
        n, t = timeit.Timer(lambda b=nb: set_priority(b, 2, False)).autorange()
        rows.append((label, "priority splice (insert)", t / n * 1e6))
    return rows


# ---------------------------------------------------------------------- HTTP clients
_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'


def _sse_server(port: int) -> None:
    import uvicorn

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(16):
            await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="error", access_log=False, backlog=4096)


async def _run_aiohttp(url: str, n: int, conc: int, body: bytes) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        sem = asyncio.Semaphore(conc)

        async def one() -> None:
            async with sem, s.post(url, data=body) as r:
                async for _ in r.content.iter_any():
                    pass

        await asyncio.gather(*(one() for _ in range(n)))


async def _run_qosgate(url: str, n: int, conc: int, body: bytes) -> None:
    """The gateway's own upstream client (``runtime/upstream/transport.py``)."""
    from qosgate.runtime.upstream.transport import Pool

    pool = Pool(url.rsplit("/v1/", 1)[0], 5.0, None)
    head = pool.head("POST", "/v1/chat/completions")
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            conn = await pool.request(head, body)
            while await conn.read_some():
                pass
            pool.release(conn)

    await asyncio.gather(*(one() for _ in range(n)))
    pool.close()


async def _run_httpx(url: str, n: int, conc: int, body: bytes) -> None:
    import httpx

    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(limits=limits, timeout=60) as c:
        sem = asyncio.Semaphore(conc)

        async def one() -> None:
            async with sem, c.stream("POST", url, content=body) as r:
                async for _ in r.aiter_raw():
                    pass

        await asyncio.gather(*(one() for _ in range(n)))


def bench_clients(n: int = 4000, conc: int = 64) -> list[tuple[str, float, float]]:
    import uvloop

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=_sse_server, args=(port,))
    proc.start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    body = _body(1)
    rows = []
    try:
        clients: list[tuple[str, Any]] = [("qosgate", _run_qosgate), ("aiohttp", _run_aiohttp)]
        try:
            import httpx  # noqa: F401

            clients.append(("httpx", _run_httpx))
        except ImportError:  # optional: only for the comparison
            pass
        for name, fn in clients:
            uvloop.run(fn(url, 200, conc, body))  # warm up
            c0, t0 = time.process_time(), time.perf_counter()
            uvloop.run(fn(url, n, conc, body))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows.append((name, n / wall, cpu / n * 1e6))
    finally:
        proc.terminate()
        proc.join()
    return rows


def main() -> None:
    print(f"python {os.sys.version.split()[0]}, msgspec {msgspec.__version__}, "
          f"{os.cpu_count()} CPUs")
    print("\nparser: scheduler fields from a chat body (microseconds per request)")
    print(f"{'body':>8}  {'method':<28} {'us':>9}")
    for label, name, us in bench_parsers():
        print(f"{label:>8}  {name:<28} {us:>9.1f}")
    print("\nupstream client: streaming, 16 chunks/request, 64 concurrent")
    print(f"{'client':<10} {'req/s':>8} {'client CPU us/req':>18}")
    for name, rps, cpu in bench_clients():
        print(f"{name:<10} {rps:>8.0f} {cpu:>18.0f}")


if __name__ == "__main__":
    main()
