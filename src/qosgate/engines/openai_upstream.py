"""An OpenAI-compatible engine over HTTP (vLLM, SGLang, llama.cpp server, TGI): one replica.

One aiohttp connection pool per upstream, kept alive. The client's body is forwarded byte for byte
except the top-level ``priority``, which is set to the request's band in the engine's own polarity
(``priority_polarity``), or removed for engines that do not schedule by priority:

see ``engines/splice.py`` for the polarities (with the vLLM/SGLang sources cited).

Pulling a request back or a client leaving cancels the call, which closes its connection: vLLM and
SGLang abort a request whose client disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from qosgate.engines.base import Call, Job
from qosgate.engines.splice import Polarity, engine_priority, set_priority

log = logging.getLogger("qosgate.upstream")

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_PROBE_EVERY_S = 5.0


class UpstreamSettings(BaseModel):
    """One upstream replica (an entry of the config's ``upstreams`` list)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    name: str | None = None
    capacity: int = Field(default=64, ge=1, description="in-flight window at this replica")
    priority_polarity: Polarity = Field(
        default="none",
        description="vllm: smaller runs first (needs --scheduling-policy priority); "
        "sglang: larger runs first (needs --enable-priority-scheduling); none: strip it",
    )
    api_key: str | None = None
    models: tuple[str, ...] = Field(
        default=(), description="model ids served; empty = ask the upstream's /v1/models"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0)

    @field_validator("url")
    @classmethod
    def _url_ok(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {v!r}")
        return v.rstrip("/").removesuffix("/v1")


class OpenAIUpstream:
    pausable = False

    def __init__(self, cfg: UpstreamSettings, index: int = 0) -> None:
        self.cfg = cfg
        self.name = cfg.name or f"upstream-{index}"
        self.capacity = cfg.capacity
        self.polarity: Polarity = cfg.priority_polarity
        self.base = cfg.url
        self._models: list[str] = list(cfg.models)
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self._headers["Authorization"] = f"Bearer {cfg.api_key}"
        self._healthy = False
        self._probe: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ life
    @property
    def ready(self) -> bool:
        return self._healthy

    def models(self) -> list[str]:
        return list(self._models)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        await self.check()
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def check(self) -> bool:
        """Probe ``GET /v1/models``; learn the model ids if none were configured."""
        assert self._session is not None
        try:
            async with self._session.get(
                self.base + "/v1/models",
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s),
            ) as resp:
                ok = resp.status == 200
                if ok and not self.cfg.models:
                    data = await resp.json()
                    ids = [m["id"] for m in data.get("data", []) if "id" in m]
                    if ids:
                        self._models = ids
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError):
            ok = False
        if ok != self._healthy:
            log.log(logging.INFO if ok else logging.WARNING,
                    "upstream %s %s", self.base, "is up" if ok else "is unreachable")
        self._healthy = ok
        return ok

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(_PROBE_EVERY_S)
            await self.check()

    # ------------------------------------------------------------------ one call
    def body_for(self, call: Call) -> bytes:
        job: Job = call.job
        value = engine_priority(self.polarity, call.level(), call.levels())
        return set_priority(job.body, value, job.has_priority)

    def pause(self, rid: str) -> None:  # pragma: no cover - not pausable: never asked
        raise NotImplementedError

    def resume(self, rid: str) -> None:  # pragma: no cover
        raise NotImplementedError

    async def run(self, call: Call) -> None:
        assert self._session is not None
        job = call.job
        sink = call.sink
        body = self.body_for(call)
        url = self.base + _PATHS[job.route]
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self._session.post(url, data=body, headers=self._headers)
            ctype = resp.headers.get("Content-Type", "application/json").encode()
            if resp.status >= 400:
                data = await resp.read()
                await sink.start(resp.status, [(b"content-type", ctype)])
                await sink.send(data, False)
                call.failed(f"upstream_{resp.status}")
                return
            headers = [(b"content-type", ctype)]
            if not job.stream:
                data = await resp.read()
                if not call.first_token():
                    return
                await sink.start(resp.status, headers)
                await sink.send(data, False)
                m = _COMPLETION_TOKENS.search(data)
                p = _PROMPT_TOKENS.search(data)
                call.done(int(m.group(1)) if m else 0, int(p.group(1)) if p else None)
                return
            events = 0
            usage: tuple[int, int | None] | None = None
            first = True
            async for chunk in resp.content.iter_any():
                if first:
                    if not call.first_token():
                        return
                    await sink.start(resp.status, [*headers, (b"cache-control", b"no-cache")])
                    first = False
                events += chunk.count(b"data:")
                if b'"completion_tokens"' in chunk:
                    m = _COMPLETION_TOKENS.search(chunk)
                    p = _PROMPT_TOKENS.search(chunk)
                    if m:
                        usage = (int(m.group(1)), int(p.group(1)) if p else None)
                await sink.send(chunk)
            if first and not call.first_token():
                return
            if first:
                await sink.start(resp.status, headers)
            await sink.send(b"", False)
            if usage is not None:
                call.done(*usage)
            else:  # without usage: data events less the role chunk and [DONE]
                call.done(max(0, events - 2))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._healthy = self._healthy and sink.started
            log.warning("upstream %s: %s", self.base, exc)
            if resp is not None:
                resp.close()
            call.failed("upstream_disconnected" if sink.started else "upstream_unreachable")
        except BaseException:
            if resp is not None:
                resp.close()  # cancelled: drop the connection so the engine aborts at once
            raise
        finally:
            if resp is not None:
                resp.release()
