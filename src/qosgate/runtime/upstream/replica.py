"""An OpenAI-compatible engine over HTTP (vLLM, SGLang, llama.cpp server, TGI): one replica.

One pool of kept-alive HTTP/1.1 connections per upstream. The client's body is forwarded byte for
byte except the top-level ``priority``, which is set to qosgate's order for the request (its band,
then its rank in the band: ``core/queueing/engine_order.py``) in the engine's own polarity
(``priority_polarity``), or removed for engines that do not schedule by priority: see
``wire/splice.py`` for the polarities (with the vLLM/SGLang sources cited). A client that did
not ask for a stream is not sent one either: what vLLM serves only whole (``prompt_logprobs``,
beam search, echo with prompt logprobs) stays as it is. Its answer's first byte is the whole
answer, so its bound is derived from its output cap and the engine's measured time per token
(``core/progress.py``); and an engine that holds requests and stops producing tokens (its
``/metrics`` counters stand still, or it answers no probe) is found stalled by its probes, its
unbegun calls retried elsewhere.

Pulling a request back or a client leaving cancels the call, which closes its connection: vLLM and
SGLang abort a request whose client disconnected.

The parts, each in its own module: the HTTP/1.1 client (``transport.py``), the streamed
response relayed to the client from the connection's callbacks (``relay.py``), the call's time
bounds (``watchdog.py``), an engine's error answer (``errors.py``) and batches of embeddings
(``embeddings.py``); its settings are ``settings.UpstreamSettings``. This module is the
``Engine`` port over them: health probes, the engine's load scraped from its ``/metrics``, and
one call from the request written to its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import Any

import msgspec

from qosgate.core.facts import AttemptFailed
from qosgate.core.progress import StallWatch, whole_answer_s
from qosgate.core.reasons import upstream
from qosgate.core.signals import LoadSignals
from qosgate.runtime.ports import Call, Health, Withdrawn
from qosgate.runtime.upstream.embeddings import UpstreamEmbeddings
from qosgate.runtime.upstream.errors import error_status
from qosgate.runtime.upstream.relay import Gather, Relay, usage_counts, usage_key
from qosgate.runtime.upstream.transport import (
    Connection,
    Pool,
    UpstreamError,
    refused_connection,
    with_request_id,
)
from qosgate.runtime.upstream.watchdog import Watchdog
from qosgate.settings import UpstreamSettings, upstream_name
from qosgate.wire.answers import model_card
from qosgate.wire.engine_metrics import parse_engine_metrics
from qosgate.wire.engine_request import EngineRequest, Route, Unservable
from qosgate.wire.resume import Transcript, continuation
from qosgate.wire.splice import Polarity, PriorityOrder, engine_priority, set_priority
from qosgate.wire.tokenize import token_ids

log = logging.getLogger("qosgate.upstream")

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "embeddings": "/v1/embeddings"}
_models_decoder = msgspec.json.Decoder()


class OpenAIUpstream:
    pausable = False
    remote = True
    embeds = True  # /v1/embeddings is forwarded (merged into batches)

    def __init__(self, cfg: UpstreamSettings, index: int = 0) -> None:
        self.cfg = cfg
        self.name = upstream_name(cfg, index)
        self.max_window = cfg.max_window
        self.polarity: Polarity = cfg.priority_polarity
        self.priority_order: PriorityOrder = cfg.priority_order
        # its queue runs in the order sent only where a polarity is sent, and only in full
        self.ordered = self.polarity != "none" and self.priority_order == "full"
        # it continues a stream from token ids (vLLM's token-id prompts and returned ids; an
        # engine not named is taken for vLLM, and a stream it answers without ids is not
        # continued)
        self.resumes = cfg.engine in (None, "vllm")
        self.base = cfg.url
        self._models: list[str] = list(cfg.models)
        self._pool = Pool(cfg.url, cfg.connect_timeout_s, cfg.api_key)
        self._heads = {route: self._pool.head("POST", path) for route, path in _PATHS.items()}
        self._models_head = self._pool.head("GET", "/v1/models", json_body=False)
        self._metrics_head = self._pool.head("GET", "/metrics", json_body=False)
        self._tokenize_head = self._pool.head("POST", "/tokenize")
        self._healthy = False
        self._cards: list[dict[str, Any]] = []
        self._created = int(time.time())
        # the time bounds of the calls under way, by request id: a stalled engine's are fired
        self._live: dict[str, Watchdog] = {}
        self._stall = StallWatch(cfg.stall_s) if cfg.stall_s is not None else None
        self._embeddings = UpstreamEmbeddings(self._pool, self._heads["embeddings"],
                                              cfg.total_timeout_s, self.base)

    # ------------------------------------------------------------------ life
    @property
    def ready(self) -> bool:
        return self._healthy

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        return None  # the engine itself judges what it receives

    def models(self) -> list[str]:
        return list(self._models)

    def model_cards(self) -> list[dict[str, Any]]:
        """The engine's own ``/v1/models`` entries (its last answer); a configured model it
        does not list gets a bare entry."""
        listed = {m["id"]: m for m in self._cards}
        return [listed.get(mid) or model_card(mid, "upstream", None, self._created)
                for mid in self._models]

    async def start(self) -> None:
        return None  # nothing to open: the driver probes every replica at start-up

    async def close(self) -> None:
        self._pool.close()

    async def probe(self) -> Health:
        """``GET /v1/models`` within the probe timeout; learns the model ids if none were
        configured. Never raises: anything but a 200 in time is ``up=False``."""
        conn: Connection | None = None
        self._pool.prune()
        try:
            async with asyncio.timeout(self.cfg.probe_timeout_s):
                conn = await self._pool.request(self._models_head, b"")
                data = await conn.read_all()
            ok = conn.status == 200
            self._pool.release(conn)
            conn = None
            if ok:
                listed = _models_decoder.decode(data)
                cards = [m for m in listed.get("data", [])
                         if isinstance(m, dict) and isinstance(m.get("id"), str)]
                if self.cfg.models:  # configured: those, as the engine lists them if it does
                    cards = [m for m in cards if m["id"] in self.cfg.models]
                elif cards:
                    self._models = [m["id"] for m in cards]
                if cards:
                    self._cards = cards
        except (TimeoutError, OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        finally:
            if conn is not None:
                conn.close()
        signals = await self._scrape() if ok and self.cfg.scrape_metrics else None
        if self._stall is not None and self._stalled(self._stall, ok, signals):
            ok = False
        self._healthy = ok
        return Health(up=ok, models=tuple(self._models) if self._models else None,
                      signals=signals)

    def _stalled(self, watch: StallWatch, answered: bool, signals: LoadSignals | None) -> bool:
        """One reading of the engine's progress; once it is stalled, the calls sent to it whose
        answer has not begun end as failed attempts (``engine_stalled``), which the core
        retries on another replica: they would otherwise wait out their own bounds."""
        was = watch.stalled
        counter = None if signals is None else signals.tokens_total
        if not watch.observe(time.monotonic(), counter=counter, answered=answered,
                             busy=bool(self._live)):
            if was:
                log.warning("upstream %s: making progress again", self.base)
            return False
        unbegun = [dog for dog in self._live.values() if not dog.delivered]
        if not was or unbegun:
            log.warning("upstream %s: stalled (no token for %.0f s while holding %d "
                        "requests); %d not begun are retried elsewhere", self.base,
                        watch.stall_s, len(self._live), len(unbegun))
        for dog in unbegun:
            dog.fire("engine_stalled")
        return True

    async def _scrape(self) -> LoadSignals | None:
        """The engine's load from its ``/metrics`` (None if it has none or it fails). Stamped
        with time 0: the driver stamps it with its own clock when it hands it to the core."""
        data = await self._ask(self._metrics_head, b"", self.cfg.probe_timeout_s)
        if data is None:
            return None
        try:
            sig = parse_engine_metrics(data.decode("utf-8", "replace"), 0.0, self.cfg.engine)
        except ValueError:
            return None
        empty = (sig.running, sig.waiting, sig.kv_usage, sig.preemptions_total)
        return None if empty == (None, None, None, None) else sig

    async def tokenize(self, request: bytes) -> list[int] | None:
        """The token ids of ``request`` (a ``/tokenize`` body: ``wire/tokenize.py``) as this
        engine renders it, within ``tokenize_timeout_s``; None on any failure (the caller
        falls back to the keys hashed from the text)."""
        data = await self._ask(self._tokenize_head, request, self.cfg.tokenize_timeout_s)
        return None if data is None else token_ids(data)

    async def forward(self, method: str, path: str, body: bytes, rid: str
                      ) -> tuple[int, bytes | None, bytes] | None:
        """A utility route's call passed through as the client made it (``/tokenize``,
        ``/version``, ...: ``server/passthrough.py``), named by ``rid`` to the engine and
        bounded like a probe: (status, content type, body), or None if the engine could not
        be reached or answered nothing in time."""
        head = with_request_id(self._pool.head(method, path, json_body=bool(body)), rid)
        conn: Connection | None = None
        try:
            async with asyncio.timeout(self.cfg.probe_timeout_s):
                conn = await self._pool.request(head, body)
                data = await conn.read_all()
            answer = (conn.status, conn.content_type, data)
            self._pool.release(conn)
            conn = None
        except (TimeoutError, OSError) as exc:
            log.warning("upstream %s: %s %s: %r", self.base, method, path, exc)
            return None
        finally:
            if conn is not None:
                conn.close()
        return answer

    async def _ask(self, head: bytes, body: bytes, timeout_s: float) -> bytes | None:
        """A small side request (not a client's), read whole within ``timeout_s``: the body
        of a 200 answer; None for any other answer, a timeout or a failed connection."""
        conn: Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._pool.request(head, body)
                data = await conn.read_all()
            status = conn.status
            self._pool.release(conn)
            conn = None
        except (TimeoutError, OSError) as exc:
            log.debug("upstream %s: %r", self.base, exc)
            return None
        finally:
            if conn is not None:
                conn.close()
        return data if status == 200 else None

    async def check(self) -> bool:
        return (await self.probe()).up

    # ------------------------------------------------------------------ one call
    def _request_for(self, call: Call) -> tuple[bytes, bytes]:
        """The call's head and body. A stream whose client has had part of its answer already
        (evicted, or moved off a failed replica) continues: ``/v1/completions`` from its
        prompt's token ids and those it delivered (``wire/resume.py``), named to the engine
        apart from its earlier calls (vLLM may not have dropped the aborted one yet)."""
        engine_request: EngineRequest = call.engine_request
        value = engine_priority(self.polarity, call.order(), call.levels(), self.priority_order)
        tr = self._transcript(call)
        if tr is not None and call.sink.started:
            tr.next_segment()
            prompt = tr.prompt_ids or []
            body = continuation(engine_request.body, prompt, tr.ids, call.output_cap())
            call.continued(len(prompt) + len(tr.ids), None)
            head = with_request_id(self._heads["completions"],
                                   f"{engine_request.rid}-{tr.segment}")
            return head, set_priority(body, value, False)
        body = engine_request.body if tr is None else tr.engine_body(engine_request.body)
        return (with_request_id(self._heads[engine_request.route], engine_request.rid),
                set_priority(body, value, engine_request.has_priority))

    def _transcript(self, call: Call) -> Transcript | None:
        """The call's transcript where this engine continues streams from token ids."""
        return call.transcript if self.resumes else None

    def pause(self, rid: str) -> None:  # pragma: no cover - not pausable: never asked
        raise NotImplementedError

    def resume(self, rid: str) -> None:  # pragma: no cover
        raise NotImplementedError

    async def run(self, call: Call) -> None:
        await self._run(call, None, None)

    def start_call(self, call: Call) -> Coroutine[Any, Any, None]:
        """``run(call)``, for the driver to make a task of, with its request written *now*.

        While the scheduler dispatches the request, if a kept-alive connection is free, the
        request goes out at once: not a loop turn later when the call's task first runs (which,
        under load, is behind a burst of relayed tokens: 0.2 ms at the median, 1-2 ms at p90).
        The coroutine returned closes that connection if the call is cancelled before its task
        ever ran (``_SentCall``): the engine aborts.
        """
        sent: Connection | None = None
        request: tuple[bytes, bytes] | None = None
        try:
            request = self._request_for(call)
            sent = self._pool.send_now(*request)
        except Exception:  # raised again by the task, where it is reported as before
            request = None
        coro = self._run(call, request, sent)
        return coro if sent is None else _SentCall(coro, sent)

    async def run_batch(self, calls: list[Call]) -> None:
        """Serve a batch of embeddings requests (``runtime/batching.py``): see
        ``UpstreamEmbeddings``."""
        await self._embeddings.run_batch(calls)

    async def _whole(self, call: Call, conn: Connection, dog: Watchdog) -> None:
        """Read the engine's whole answer and pass it on once, as the engine sent it.

        Its first byte is the request's first token (``first_token``): for a whole answer that
        is the answer itself. Only once it is delivered is the core told of a first byte, so
        until then a failed call is an attempt the core may retry elsewhere, and the request
        can be pulled back: nothing reached its client."""
        parts = await Gather(call, dog, conn).wait()
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        usage = (usage_counts(data) if usage_key(call.engine_request.route) in data
                 else None)
        sink = call.sink
        # the core's first byte: raises Withdrawn if the request was pulled back meanwhile
        await sink.start(conn.status, [(b"content-type", conn.content_type
                                        or b"application/json")])
        await sink.send(data, False)
        call.done(*(usage or (0, None, None)))

    async def _run(self, call: Call, request: tuple[bytes, bytes] | None,
                   sent: Connection | None) -> None:
        engine_request = call.engine_request
        sink = call.sink
        conn: Connection | None = sent
        cfg = self.cfg
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        first_byte_s = engine_request.first_byte_timeout_s
        if not engine_request.stream:  # its first byte is its whole answer
            first_byte_s = whole_answer_s(first_byte_s, call.output_cap(), call.token_s(),
                                          assumed_token_s=cfg.assumed_token_s,
                                          margin=cfg.whole_answer_margin)
        dog = Watchdog(loop, task, first_byte_s, cfg.idle_timeout_s, cfg.total_timeout_s)
        self._live[engine_request.rid] = dog
        relay: Relay | None = None
        tr = self._transcript(call)
        try:
            head, body = request if request is not None else self._request_for(call)
            if engine_request.stream:
                relay = Relay(call, dog, tr)
                conn = await self._pool.request(head, body, relay.run, sent)
                if relay.outcome == "complete":
                    conn = None  # back in the pool (or closed) already
                    if tr is not None and tr.segment:
                        call.continued(0, tr.cached)
                    call.done(*relay.counts())
                    return
                # an error status: handled below
            else:
                conn = await self._pool.request(head, body, None, sent)
            status = conn.status
            ctype = conn.content_type or b"application/json"
            if status >= 400:
                data = await conn.read_all()
                if sink.started:  # a continuation the engine would not take
                    log.warning("upstream %s: continuing %s: %s %r", self.base,
                                engine_request.rid, status, data[:200])
                    self._broke(call, tr, upstream(status), status < 500 and status != 429)
                    return
                error_status(call, status, data, ctype, conn.retry_after)
                return
            if not engine_request.stream:
                await self._whole(call, conn, dog)
                return  # the connection goes back to the pool below
        except Withdrawn:
            return  # pulled back meanwhile: nothing may reach the client
        except asyncio.CancelledError:
            reason = dog.fired
            if reason is None or task.uncancel() > 0:
                raise  # pulled back, client gone, or shutdown
            log.warning("upstream %s: %s for %s", self.base, reason, engine_request.rid)
            if conn is not None:
                conn.close()
                conn = None
            if sink.started:
                self._broke(call, tr, reason, False, timeout=True)
            else:
                call.attempt_failed(AttemptFailed(reason))
        except (TimeoutError, OSError) as exc:
            log.warning("upstream %s: %s", self.base, exc)
            got = conn is not None and conn.got_bytes
            if conn is not None:
                conn.close()
                conn = None
            if sink.started:
                self._broke(call, tr, "upstream_disconnected", False)
            else:
                refused = refused_connection(exc)
                if refused or not got:
                    reason = "upstream_unreachable"
                elif isinstance(exc, UpstreamError) and "invalid HTTP" in str(exc):
                    reason = "upstream_bad_response"  # garbled: it answered, not HTTP
                else:
                    reason = "upstream_disconnected"
                call.attempt_failed(AttemptFailed(reason, unreachable=refused))
        finally:
            dog.stop()
            if self._live.get(engine_request.rid) is dog:
                del self._live[engine_request.rid]
            if conn is not None:
                # cancelled, or left early: drop the connection so that the engine aborts at once
                if conn.complete and not conn.parts:
                    self._pool.release(conn)
                else:
                    conn.close()


    @staticmethod
    def _broke(call: Call, tr: Transcript | None, reason: str, final: bool,
               timeout: bool = False) -> None:
        """The call failed after its client had part of the answer: a stream that can
        continue is handed to the core to go on elsewhere (``Call.moved``); else, or where the
        failure would recur anywhere (``final``: the engine judged the request), it ends."""
        if not final and tr is not None and tr.continuable:
            call.moved(AttemptFailed(reason))
        elif timeout:
            call.timed_out(reason)
        else:
            call.failed(reason)


class _SentCall(Coroutine[Any, Any, None]):
    """``_run`` for a request ``start_call`` already wrote: the coroutine the driver makes a
    task of.

    A coroutine cancelled before its first step runs none of its code (the ``CancelledError`` is
    raised at its very start), so no ``finally`` in ``_run`` could close the connection the
    request went out on, and the engine would go on generating for nobody. This wrapper sees
    that: thrown into or closed before it ever ran, it closes the connection first. Everything
    else goes to ``_run`` as it is.
    """

    __slots__ = ("_conn", "_coro")

    def __init__(self, coro: Coroutine[Any, Any, None], conn: Connection) -> None:
        self._coro = coro
        self._conn: Connection | None = conn  # until ``_run`` runs and owns it

    def send(self, value: Any) -> Any:
        self._conn = None
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None) -> Any:
        self._abort()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._abort()
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        return self._coro.__await__()

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # cancelled before its task ran: the engine aborts
