"""Any ``StepEngine`` served in real time inside the event loop.

One step loop per engine. For a *modelled* engine (the simulated GPU) a step is computed at once and
the loop sleeps its modelled duration (times ``time_scale``) before releasing the step's tokens, so
clients see the timing the model predicts. For a *real* engine (llama.cpp) ``step()`` runs in a
worker thread; control calls (add/pause/resume/abort) that arrive meanwhile are applied between two
steps, so the engine is only ever touched by one thread at a time.

Tokens fan out to one small channel per request; the request's own coroutine (``run``) formats
them as OpenAI chunks and writes them to the client. The scheduler's decisions map onto the engine:
pause/resume keep the sequence's state (a paused request resumes at the next token), cancelling
``run`` aborts the sequence and frees its slot at once.

Pause, as the client sees it: from the moment the scheduler pauses a request until it resumes it,
nothing more reaches that client. A token (or the finish) that the step in flight still produced
for it waits in its channel and goes out, in order, on resume. So a request paused before its first
token keeps its sequence (and its prefill) instead of being aborted and restarted, and a request
whose last token was in flight is completed only once the scheduler has it running again (the
core accepts ``complete``/``fail`` only from a dispatched or running request).

``text=True`` is for engines that run a real model (llama.cpp): ``run`` decodes the body's
messages/prompt and sampling (``wire/textreq.py``) into the ``SeqSpec``; a bad value is answered
with a 400 in OpenAI's error format. The simulated engine only needs the counts (``text=False``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from qosgate.models.step import BadTextRequest, FinishEvent, SeqSpec, StepEngine, StepResult
from qosgate.runtime.embeddings import deliver
from qosgate.runtime.ports import Call, Health
from qosgate.wire.answers import Formatter, formatter_for, model_card
from qosgate.wire.engine_request import Route, Unservable
from qosgate.wire.errors import error_json, invalid_request
from qosgate.wire.sse import JSON_HEADERS, SSE_HEADERS
from qosgate.wire.textreq import TextRequest, parse_text_request

# a step that ends this little behind schedule (timer granularity) still starts on schedule
_CATCH_UP_S = 0.002
# paused ids kept before those of calls that never started are dropped (see ``pause``)
_PRUNE_PAUSED = 4096


class _Channel:
    __slots__ = ("error", "error_param", "finish", "ids", "tokens", "waiter")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.ids: list[int] = []  # the tokens' ids, in step with ``tokens``
        self.finish: FinishEvent | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # the member at fault, if the engine named one
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class InProcessEngine:
    """Runs ``engine`` in real time and serves OpenAI requests from it (see the module doc)."""

    def __init__(
        self,
        engine: StepEngine,
        *,
        name: str = "inprocess",
        max_window: int | None = None,
        models: list[str] | None = None,
        modelled_time: bool = True,
        time_scale: float = 1.0,
        text: bool = False,
        pausable: bool = True,
        max_model_len: int | None = None,
        eos_after: int = 256,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        # report the prompt tokens taken from the engine's prefix cache in each usage, as vLLM's
        # --enable-prompt-tokens-details
        self.prompt_tokens_details = prompt_tokens_details
        # the context a sequence may fill (prompt and output); None: the engine sets no bound
        self.max_model_len = max_model_len
        self.eos_after = eos_after  # a simulated model's answer length when nothing caps it
        self.name = name
        self.max_window = max_window if max_window is not None else engine.max_num_seqs
        self._models = models or ["qosgate-sim"]
        self._created = int(time.time())
        self.modelled_time = modelled_time
        self.time_scale = time_scale
        self.text = text
        # False: the core never pauses here; it pulls a request back only before its first token
        # (by cancelling the call), as it would in front of an external engine
        self.pausable = pausable
        self.resumes = False  # it pauses instead: its sequences keep their state here
        self.ordered = engine.ordered
        self.remote = False
        self._chans: dict[str, _Channel] = {}
        self._paused: set[str] = set()
        self._stepping = False
        self._pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._idle: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.steps = 0
        self.tokens_out = 0
        self.pauses = 0
        self.evictions = 0
        # embeddings (models/llama_embed.py): a context of its own, batches in a worker thread
        self.embedder: Any | None = None

    # ------------------------------------------------------------------ Engine protocol
    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        """A text engine refuses here what it cannot serve: the request's own values
        (``textreq.py``) and what needs the model (``check``: the prompt against the context,
        token ids, the grammar). The Responses API is not one it answers: its events are
        another shape than the chunks it writes."""
        if route == "responses":
            return Unservable("The built-in engine does not serve the Responses API "
                              "(/v1/responses): put qosgate in front of an engine that does, "
                              "such as vLLM (--upstream).", None)
        if not self.text:
            return None
        try:
            req = parse_text_request(body, route)
            check = getattr(self.engine, "check", None)
            if callable(check):
                check(self._text_spec("check", req, 0), req.max_tokens_param)
        except BadTextRequest as exc:
            return Unservable(str(exc), exc.param)
        return None

    @staticmethod
    def _text_spec(rid: str, req: TextRequest, priority: int) -> SeqSpec:
        """The sequence a text request runs as; its cap is the body's own (None: the engine
        runs to the end of its context)."""
        return SeqSpec(
            seq_id=rid,
            prompt_tokens=1,
            max_tokens=req.max_tokens,
            prompt=req.prompt,
            messages=req.messages,
            sampling=req.sampling,
            engine_priority=priority,
        )

    def models(self) -> list[str]:
        return list(self._models)

    def model_cards(self) -> list[dict[str, Any]]:
        return [model_card(m, "qosgate", self.max_model_len, self._created) for m in self._models]

    async def probe(self) -> Health:
        return Health(up=self.ready, models=tuple(self._models))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        close = getattr(self.engine, "close", None)
        if callable(close):  # llama.cpp: free the context and the model (waits for a step)
            await asyncio.to_thread(close)
        if self.embedder is not None:
            await asyncio.to_thread(self.embedder.close)
            self.embedder = None

    # ------------------------------------------------------------------ embeddings
    @property
    def embeds(self) -> bool:
        return self.embedder is not None

    async def run_batch(self, calls: list[Call]) -> None:
        """A batch of embeddings requests: all their inputs pooled in one llama.cpp decode
        (if it fits the embedder's ``n_batch``), in a worker thread; each client gets its own
        vectors and its own token count."""
        emb = self.embedder
        if emb is None:
            body = error_json("This replica does not serve embeddings.",
                              "invalid_request_error", "not_supported")
            for c in calls:
                c.refused(400, body)
            return
        items: list[str | list[int]] = []
        for c in calls:
            items.extend(c.engine_request.inputs or [])
        try:
            vectors, counts = await asyncio.to_thread(emb.embed, items)
        except ValueError as exc:  # a token id out of the vocabulary
            if len(calls) > 1:  # find whose: each on its own
                for c in calls:
                    await self.run_batch([c])
                return
            calls[0].refused(400, invalid_request(str(exc), "input", 400))
            return
        at = 0
        for c in calls:
            n = len(c.engine_request.inputs or [])
            await deliver(c, c.engine_request.model, vectors[at:at + n], sum(counts[at:at + n]))
            at += n

    def pause(self, rid: str) -> None:
        paused = self._paused
        if len(paused) > _PRUNE_PAUSED:
            # a call cancelled before it ever ran cannot discard its id: drop ids without a call
            paused.intersection_update(self._chans)
        paused.add(rid)
        self.pauses += 1
        self._op(self.engine.pause, rid)

    def resume(self, rid: str) -> None:
        self._paused.discard(rid)
        self._op(self.engine.resume, rid)
        ch = self._chans.get(rid)
        if ch is not None:
            ch.wake()
        self._kick()

    async def run(self, call: Call) -> None:
        engine_request = call.engine_request
        # a request that sets no cap runs to where its context ends (vLLM's default cap); a
        # simulated model ends its answer by itself after ``eos_after`` tokens
        room = (self.max_model_len - engine_request.prompt_tokens
                if self.max_model_len is not None else None)
        cap = engine_request.max_tokens if engine_request.max_tokens is not None else room
        max_tokens = max(1, cap if cap is not None else self.eos_after)
        if not self.text:
            spec = SeqSpec(
                seq_id=engine_request.rid,
                prompt_tokens=max(1, engine_request.prompt_tokens),
                max_tokens=max_tokens,
                target_output_tokens=self.eos_after if engine_request.max_tokens is None else None,
                engine_priority=call.order(),
            )
            await self.generate(call, spec)
            return
        try:
            req = parse_text_request(engine_request.body, engine_request.route)
        except BadTextRequest as exc:
            # a queued request's client must not see anything
            await self._unpaused(engine_request.rid)
            await self._refuse(call, str(exc), exc.param)
            return
        spec = self._text_spec(engine_request.rid, req, call.order())
        spec.prompt_tokens = max(1, engine_request.prompt_tokens)
        await self.generate(call, spec)

    # ------------------------------------------------------------------ serving one sequence
    async def _refuse(self, call: Call, message: str, param: str | None = None) -> None:
        """Answer 400 in OpenAI's format, then end the request as rejected by the engine."""
        sink = call.sink
        if not sink.started:
            await sink.start(400, JSON_HEADERS)
            await sink.send(invalid_request(message, param, "engine_rejected"), False)
        await self._unpaused(call.engine_request.rid)  # paused while the answer was being written
        call.failed("engine_rejected")

    async def _unpaused(self, rid: str) -> None:
        """Wait while the scheduler holds ``rid`` paused (it is queued then: nothing it does may
        reach the client or end it)."""
        if rid not in self._paused:
            return
        ch = self._chans.get(rid)
        own = ch is None
        if ch is None:
            ch = self._chans[rid] = _Channel()
        loop = asyncio.get_running_loop()
        try:
            while rid in self._paused:
                ch.waiter = loop.create_future()
                await ch.waiter
                ch.waiter = None
        finally:
            if own:
                self._chans.pop(rid, None)

    async def generate(self, call: Call, spec: SeqSpec, token_ids: bool | None = None) -> None:
        """Add ``spec`` to the engine and serve its tokens to ``call`` until it finishes;
        ``token_ids``: vLLM's ``return_token_ids`` members (``answers.Formatter``), for an
        engine that mirrors vLLM."""
        engine_request = call.engine_request
        sink = call.sink
        rid = spec.seq_id
        paused = self._paused
        finished = False
        try:
            # paused between dispatch and this call starting: do not even add it yet
            await self._unpaused(rid)
            ch = self._chans[rid] = _Channel()
            self._op(self._add, spec)
            self._kick()
            fmt = formatter_for(engine_request.route, rid, engine_request.model,
                                engine_request.include_usage, engine_request.body,
                                token_ids, spec.context_ids)
            # the formatter that writes ids, when they are asked for
            by_id = fmt if isinstance(fmt, Formatter) and token_ids is not None else None
            texts: list[str] = []
            ids: list[int] = []
            sent = 0
            loop = asyncio.get_running_loop()
            while True:
                if rid in paused or (not ch.tokens and ch.finish is None and ch.error is None):
                    ch.waiter = loop.create_future()
                    await ch.waiter
                    ch.waiter = None
                    continue
                if ch.error is not None:
                    finished = True
                    self._chans.pop(rid, None)
                    await self._refuse(call, ch.error, ch.error_param)
                    return
                toks = ch.tokens
                if toks:
                    tids = ch.ids
                    ch.tokens = []
                    ch.ids = []
                    if engine_request.stream:
                        # a token with no text of its own (the start of a character or of a
                        # possible stop string, held back) sends no chunk, as llama.cpp's server
                        head = b""
                        if not sink.started:  # raises Withdrawn if pulled back meanwhile
                            await sink.start(200, SSE_HEADERS)
                            head = fmt.opening()  # (first: a Responses stream numbers events)
                        if by_id is None:
                            out = head + b"".join([fmt.token(t) for t in toks if t])
                        else:
                            out = head + b"".join(
                                [by_id.token(t, i) for t, i in zip(toks, tids, strict=True) if t])
                        if out:
                            await sink.send(out)
                        sent += len(toks)
                        call.progress(sent)
                    else:
                        texts.extend(toks)
                        ids.extend(tids)
                    continue
                fin = ch.finish
                if fin is not None:
                    finished = True
                    self._chans.pop(rid, None)
                    reason = "length" if fin.reason == "length" else "stop"
                    cached = fin.cached_tokens if self.prompt_tokens_details else None
                    if engine_request.stream:
                        if not sink.started:
                            await sink.start(200, SSE_HEADERS)
                            await sink.send(fmt.opening())
                        await sink.send(
                            fmt.closing(reason, fin.prompt_tokens, fin.completion_tokens,
                                        cached), False
                        )
                    else:
                        text = "".join(texts)
                        if by_id is None:
                            body = fmt.whole(text, reason, fin.prompt_tokens,
                                             fin.completion_tokens, cached)
                        else:
                            body = by_id.whole(text, reason, fin.prompt_tokens,
                                               fin.completion_tokens, cached, ids)
                        await sink.start(200, JSON_HEADERS)
                        await sink.send(body, False)
                    # paused while the end was being written (the send waited for the client):
                    # the core completes only a running request
                    await self._unpaused(rid)
                    call.done(fin.completion_tokens, fin.prompt_tokens, fin.cached_tokens)
                    return
        finally:
            paused.discard(rid)
            if not finished:
                self._chans.pop(rid, None)
                self._op(self.engine.abort, rid)
                self._kick()  # a freed slot may let a waiting sequence run

    # ------------------------------------------------------------------ the step loop
    def _op(self, fn: Callable[..., None], *args: Any) -> None:
        if self._stepping:
            self._pending.append((fn, args))
        else:
            fn(*args)

    def _add(self, spec: SeqSpec) -> None:
        """Add to the engine; a refusal (e.g. the prompt does not fit the context, a chat template
        error) goes to the request's channel, never up into the step loop."""
        try:
            self.engine.add(spec)
        except Exception as exc:  # any refusal is this request's, not the step loop's
            ch = self._chans.get(spec.seq_id)
            if ch is not None:
                ch.error = str(exc) or type(exc).__name__
                ch.error_param = getattr(exc, "param", None)
                ch.wake()

    def _kick(self) -> None:
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        target = time.monotonic()
        while not self._closed:
            if not engine.has_work():
                self._idle = loop.create_future()
                await self._idle
                self._idle = None
                target = time.monotonic()  # an idle engine starts its next step on arrival
                continue
            if self.modelled_time:
                res = engine.step()
                if res.duration_s <= 0:  # nothing schedulable until something changes
                    self._deliver(res)
                    self._idle = loop.create_future()
                    await self._idle
                    self._idle = None
                    target = time.monotonic()
                    continue
                now = time.monotonic()
                start = target if now - target < _CATCH_UP_S else now
                target = start + res.duration_s * self.time_scale
                delay = target - time.monotonic()
                # always yield, so that a step loop behind schedule cannot starve the I/O
                await asyncio.sleep(delay if delay > 0 else 0)
            else:
                self._stepping = True
                try:
                    res = await asyncio.to_thread(engine.step)
                finally:
                    self._stepping = False
                    pending, self._pending = self._pending, []
                    try:
                        for fn, args in pending:
                            fn(*args)
                    finally:
                        self.steps += 1
            self._deliver(res)

    def _deliver(self, res: StepResult) -> None:
        chans = self._chans
        self.tokens_out += len(res.tokens)
        self.evictions += len(res.evicted)
        for tok in res.tokens:
            ch = chans.get(tok.seq_id)
            if ch is not None:
                ch.tokens.append(tok.text)
                ch.ids.append(tok.token_id)
                ch.wake()
        for fin in res.finished:
            ch = chans.get(fin.seq_id)
            if ch is not None:
                ch.finish = fin
                ch.wake()
