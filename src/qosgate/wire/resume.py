"""Continue a stream from the tokens its client received: which requests can be continued
exactly, the engine request that continues one, and the transcript of what was delivered.

vLLM (0.32) takes a prompt of token ids on ``/v1/completions`` and, asked with
``return_token_ids``, returns the ids of what it generates. A request continued from its prompt's
ids plus the ids it produced, with the rest of its output cap, gets from a greedy engine the very
tokens an uninterrupted run gets (pinned on real vLLM: ``tests/e2e/vllm/test_resume.py``). A chat
continues on ``/v1/completions`` too: its prompt's ids are the chat template's rendering as vLLM
returns them in the stream's first chunk, so no template is applied twice and no text is
tokenized again (re-tokenizing the text produced so far can merge tokens differently).

The client sees one answer: the continuation's chunks are written in the first answer's format,
with its ``id``, ``created`` and ``model``; the ids the gateway asked for are written ``null``
where the client did not ask for them, as vLLM writes them then; the usage counts the client's
own prompt and every token produced. Members whose effect a continuation cannot reproduce (a
seed's random state, penalties on the tokens generated so far, stop strings the engine may be
holding back text for, several choices, log probabilities, tools, structured output) make the
request one that is never evicted after its first byte (``blocker``); the table below is the one
list, documented in docs/guides/scheduling.md (a test keeps the two equal).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from qosgate.wire import sse
from qosgate.wire.engine_request import Route
from qosgate.wire.splice import set_member

Rule = Literal["carried", "rendered", "adjusted", "ignored", "blocks"]

# JSON values that ask for nothing (compared with all whitespace removed)
_NOTHING = frozenset((b"null", b"false", b"0", b"0.0", b"[]", b"{}", b'""'))

# member -> (rule, what a continuation does with it, values that ask for nothing if it blocks)
MEMBERS: dict[str, tuple[Rule, str, frozenset[bytes]]] = {}


def _m(name: str, rule: Rule, note: str, *also: bytes) -> None:
    MEMBERS[name] = (rule, note, _NOTHING | frozenset(also))


_m("model", "carried", "the same model")
_m("messages", "rendered", "the chat template's rendering: the prompt's ids")
_m("prompt", "rendered", "replaced by its ids and the ids produced so far")
_m("chat_template", "rendered", "in the prompt's ids")
_m("chat_template_kwargs", "rendered", "in the prompt's ids")
_m("add_generation_prompt", "rendered", "in the prompt's ids")
_m("continue_final_message", "rendered", "in the prompt's ids")
_m("add_special_tokens", "rendered", "in the prompt's ids")
_m("documents", "rendered", "in the prompt's ids")
_m("max_tokens", "adjusted", "less the tokens produced")
_m("max_completion_tokens", "adjusted", "less the tokens produced")
_m("min_tokens", "adjusted", "less the tokens produced")
_m("stream", "adjusted", "the continuation is streamed")
_m("stream_options", "adjusted", "usage asked of the engine; passed on if the client asked")
_m("return_token_ids", "adjusted", "asked of the engine; passed on if the client asked")
_m("priority", "adjusted", "the gateway's engine-side priority, as for any call")
for _name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logit_bias",
              "stop_token_ids", "ignore_eos", "skip_special_tokens",
              "spaces_between_special_tokens", "include_stop_str_in_output",
              "allowed_token_ids", "bad_words", "user"):
    _m(_name, "carried", "the same value (it does not depend on the tokens produced so far)")
for _name in ("metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
              "prompt_cache_retention", "qos_class", "task_type", "latency_budget_ms",
              "parallel_tool_calls", "request_id", "cache_salt"):
    _m(_name, "ignored", "no effect on the tokens")
_m("seed", "blocks", "a seeded sampler's state cannot be restored (greedy is exact)")
_m("presence_penalty", "blocks", "penalizes the tokens generated so far, which would become prompt")
_m("frequency_penalty", "blocks", "penalizes the tokens generated so far, which would become "
   "prompt")
_m("stop", "blocks", "the engine holds back text that may begin a stop string")
_m("n", "blocks", "several choices", b"1")
_m("best_of", "blocks", "several candidates", b"1")
_m("logprobs", "blocks", "log probabilities")
_m("top_logprobs", "blocks", "log probabilities")
_m("prompt_logprobs", "blocks", "log probabilities")
_m("echo", "blocks", "the prompt returned with the answer")
_m("suffix", "blocks", "fill-in-the-middle")
_m("tools", "blocks", "tool calls")
_m("tool_choice", "blocks", "tool calls", b'"none"')
_m("functions", "blocks", "function calls")
_m("function_call", "blocks", "function calls", b'"none"')
_m("response_format", "blocks", "structured output", b'{"type":"text"}')
for _name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "guided_decoding_backend", "logits_processors", "vllm_xargs",
              "kv_transfer_params", "truncate_prompt_tokens", "audio", "modalities",
              "prediction", "reasoning_effort"):
    _m(_name, "blocks", "its effect on a continuation is not proven", b'["text"]')
del _name

_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def blocker(route: Route, stream: bool, body: bytes) -> str | None:
    """Why a request of ``route`` with ``body`` could not be continued exactly (None: it can).
    A whole answer is not continued (nothing of it reaches the gateway before its end); a member
    not in the table blocks, since its effect on a continuation is unknown."""
    if route not in ("chat", "completions"):
        return f"{route} is not continued"
    if not stream:
        return "a whole answer is not continued"
    try:
        members = _decode_members(body)
    except msgspec.DecodeError:
        return "the body is not a JSON object"
    prompt = members.get("prompt")
    if prompt is not None and bytes(prompt).lstrip()[:1] == b"[":
        prompts = msgspec.json.decode(prompt)
        if (isinstance(prompts, list) and len(prompts) > 1
                and not isinstance(prompts[0], int)):
            return "several prompts: several choices"
    options = members.get("stream_options")
    if options is not None and b'"continuous_usage_stats":true' in b"".join(bytes(options).split()):
        return "`stream_options.continuous_usage_stats`: usage in every chunk"
    temperature = members.get("temperature")
    greedy = temperature is not None and b"".join(bytes(temperature).split()) in (b"0", b"0.0")
    for name, raw in members.items():
        entry = MEMBERS.get(name)
        if entry is None:
            return f"`{name}` is not known to continue exactly"
        rule, note, nothing = entry
        if rule != "blocks":
            continue
        if name == "seed" and greedy:
            continue
        if b"".join(bytes(raw).split()) not in nothing:
            return f"`{name}`: {note}"
    return None


def transcript_for(route: Route, stream: bool, body: bytes,
                   include_usage: bool) -> Transcript | None:
    """A transcript for a request whose answer can be continued exactly; None for the others
    (``blocker``)."""
    if blocker(route, stream, body) is not None:
        return None
    wants = _decode_members(body).get("return_token_ids")
    return Transcript(route, wants is not None and bytes(wants).strip() == b"true",
                      include_usage, asked=wants is not None)


def continuation(body: bytes, prompt_ids: list[int], ids: list[int], cap: int) -> bytes:
    """The ``/v1/completions`` body that continues ``body`` (a continuable chat or completions
    request) after it produced ``ids``: prompt ``prompt_ids + ids``, the rest of ``cap``, the
    members it carries, streamed with usage and token ids. The caller sets the priority."""
    members = _decode_members(body)
    out: dict[str, Any] = {}
    for name, raw in members.items():
        entry = MEMBERS.get(name)
        if entry is not None and entry[0] == "carried":
            out[name] = raw
    out["prompt"] = prompt_ids + ids
    out["max_tokens"] = max(1, cap - len(ids))
    min_tokens = members.get("min_tokens")
    if min_tokens is not None:
        left = msgspec.json.decode(min_tokens)
        if isinstance(left, int) and not isinstance(left, bool):
            out["min_tokens"] = max(0, left - len(ids))
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    return msgspec.json.encode(out)


# ------------------------------------------------------------------ the transcript
_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[([0-9,]*)\]')
_HEAD = re.compile(rb'^data: \{("id":"[^"]*","object":"[^"]*","created":\d+,"model":"(?:[^"\\]|'
                   rb'\\.)*")')
_FINISH = b'"finish_reason":"'
# what begins a choice that carries output (completions, chat): each must come with its ids
_TOKEN_EVENT = (b'"text":', b'"delta":{"content":')
# a chat delta member a completions continuation cannot write (reasoning, tool calls, ...)
_OTHER_DELTA = re.compile(rb'"delta":\{(?:"role":"assistant",)?"(?!content"|role")')


def _ints(group: bytes) -> list[int]:
    return [int(x) for x in group.split(b",")] if group else []


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    system_fingerprint: str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_enc = msgspec.json.Encoder().encode


class Transcript:
    """What one streamed answer delivered to its client, across the engine calls that produce it.

    ``feed`` takes an engine call's body bytes as they arrive and returns the bytes for the
    client: whole events only (an event split between reads waits for its end). The first call
    (``segment`` 0) passes as the engine wrote it, its token ids written ``null`` unless the
    client asked for them; a continuation's completions chunks are rewritten in the first
    answer's format. ``ids`` are the output tokens delivered, in order: what a continuation sends
    again after the prompt's. ``exact`` turns false at an event a continuation could not
    reproduce (a reasoning or tool-call delta; an engine that returned no ids): from then on the
    request is not continued."""

    __slots__ = ("_asked", "_held", "_rest", "cached", "ended", "exact", "head", "ids",
                 "include_usage", "prompt_ids", "route", "segment", "wants_ids")

    def __init__(self, route: Route, wants_ids: bool, include_usage: bool,
                 asked: bool = False) -> None:
        self.route = route
        self.wants_ids = wants_ids
        self._asked = asked  # the body has a return_token_ids member (true or not)
        self.include_usage = include_usage
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.head: bytes | None = None  # the first answer's id, object, created and model
        self.exact = True
        self.ended = False  # the finish event was delivered
        self.segment = 0
        self.cached: int | None = None  # a continuation's prompt tokens the engine had cached
        self._rest = b""
        # a continuation's finish event, until its fingerprint (with the usage) is known
        self._held: tuple[_Choice, list[int]] | None = None

    def engine_body(self, body: bytes) -> bytes:
        """The first call's body: the client's, asking for token ids (``return_token_ids``)
        if it did not; every other byte unchanged. The answer's bytes then differ only where
        the ids are, which ``feed`` writes back as ``null``."""
        if self.wants_ids:
            return body
        return set_member(body, "return_token_ids", b"true", self._asked)

    @property
    def continuable(self) -> bool:
        """Whether the answer can go on elsewhere from here."""
        return self.exact and not self.ended and self.prompt_ids is not None

    def next_segment(self) -> None:
        """A continuation's call begins: its bytes are rewritten from here."""
        self.segment += 1
        self._rest = b""
        self._held = None
        self.cached = None

    def feed(self, data: bytes) -> bytes:
        buf = self._rest + data if self._rest else data
        cut = buf.rfind(sse.EVENT_END)
        if cut < 0:
            self._rest = buf
            return b""
        end = cut + len(sse.EVENT_END)
        self._rest = buf[end:]
        events = buf[:end]
        if self.segment == 0:
            return self._first(events)
        out = [self._continued(e) for e in events.split(sse.EVENT_END) if e]
        return b"".join(out)

    # ---- the first call: passed on, ids noted
    def _first(self, events: bytes) -> bytes:
        if self.head is None:
            m = _HEAD.match(events)
            if m is not None:
                self.head = m.group(1)
        if self.prompt_ids is None:
            m = _PROMPT_IDS.search(events)
            if m is not None:
                self.prompt_ids = _ints(m.group(1))
        found = 0
        for m in _IDS.finditer(events):
            self.ids.extend(_ints(m.group(1)))
            found += 1
        if self.exact and (found < events.count(_TOKEN_EVENT[self.route == "chat"])
                           or _OTHER_DELTA.search(events) is not None):
            self.exact = False  # a token without ids, or an event a continuation cannot write
        if _FINISH in events:
            self.ended = True
        if self.wants_ids:
            return events
        if found:
            events = _IDS.sub(b'"token_ids":null', events)
        if b'"prompt_token_ids":[' in events:
            events = _PROMPT_IDS.sub(b'"prompt_token_ids":null', events)
        return events

    # ---- a continuation: rewritten in the first answer's format
    def _continued(self, event: bytes) -> bytes:
        body = event[len(sse.DATA):] if event.startswith(sse.DATA) else event
        if body.strip() == b"[DONE]":
            held, self._held = self._held, None
            head = b"" if held is None else self._choice(held[0], held[1], None)
            return head + event + sse.EVENT_END
        chunk = _decode_chunk(body)
        if chunk.choices:
            c = chunk.choices[0]
            ids = c.token_ids or []
            self.ids.extend(ids)
            if c.finish_reason is None:
                if not c.text and self.route == "chat":
                    return b""  # (vLLM sends no chat chunk for a token with no text yet)
                return self._choice(c, ids, None)
            self.ended = True
            if chunk.system_fingerprint is not None:
                return self._choice(c, ids, chunk.system_fingerprint)
            if self.include_usage:
                return self._choice(c, ids, None)
            # the engine was asked for usage: the fingerprint comes with it, next
            self._held = (c, ids)
            return b""
        usage = chunk.usage
        if usage is not None and usage.prompt_tokens_details is not None:
            self.cached = usage.prompt_tokens_details.cached_tokens
        if not self.include_usage:
            held, self._held = self._held, None
            if held is None:
                return b""
            return self._choice(held[0], held[1], chunk.system_fingerprint)
        return self._usage(usage, chunk.system_fingerprint)

    def _choice(self, c: _Choice, ids: list[int], fingerprint: str | None) -> bytes:
        idj = _enc(ids) if self.wants_ids else b"null"
        if self.route == "chat":
            choice = b'{"index":0,"delta":{"content":' + _enc(c.text) + b'},"logprobs":null'
            if c.finish_reason is None:
                choice += b',"finish_reason":null,"token_ids":' + idj + b"}"
            else:
                choice += (b',"finish_reason":' + _enc(c.finish_reason) + b',"stop_reason":'
                           + _enc(c.stop_reason) + b',"token_ids":' + idj + b"}")
        else:
            choice = (b'{"index":0,"text":' + _enc(c.text) + b',"logprobs":null,"finish_reason":'
                      + _enc(c.finish_reason) + b',"stop_reason":' + _enc(c.stop_reason)
                      + b',"prompt_token_ids":null,"token_ids":' + idj + b"}")
        tail = b"" if fingerprint is None else b',"system_fingerprint":' + _enc(fingerprint)
        return sse.DATA + b"{" + (self.head or b"") + b',"choices":[' + choice + b"]" + tail + \
            b"}" + sse.EVENT_END

    def _usage(self, usage: _Usage | None, fingerprint: str | None) -> bytes:
        prompt = len(self.prompt_ids or ())
        done = len(self.ids)
        u = (b'{"prompt_tokens":' + str(prompt).encode() + b',"total_tokens":'
             + str(prompt + done).encode() + b',"completion_tokens":' + str(done).encode())
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = min(prompt, usage.prompt_tokens_details.cached_tokens or 0)
            u += b',"prompt_tokens_details":{"cached_tokens":' + str(cached).encode() + b"}"
        u += b"}"
        tail = b"" if fingerprint is None else b',"system_fingerprint":' + _enc(fingerprint)
        return (sse.DATA + b"{" + (self.head or b"") + b',"choices":[],"usage":' + u + tail
                + b"}" + sse.EVENT_END)
