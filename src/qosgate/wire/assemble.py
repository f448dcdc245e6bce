"""A non-streamed OpenAI answer assembled from the server-sent events of a streamed one.

The gateway asks an engine for a stream even when its client did not (so that the first-byte and
idle bounds, retries before the first token and the TTFT/TPOT metrics hold for every request);
this module turns the stream back into the ``chat.completion`` / ``text_completion`` object the
engine would have answered, for a client that wanted one piece.

The object is vLLM 0.32's, member for member and in its order (``ChatCompletionResponse``,
``CompletionResponse`` and their choices in vLLM's ``entrypoints/openai/*/protocol.py``; checked
against a real vLLM 0.32 by ``tests/wire/test_assemble.py`` on captured answers): vLLM writes a
whole answer with every member, ``null`` included, while its stream leaves unset members out.
The bytes are those of vLLM's writer (Starlette's ``JSONResponse``: ``json.dumps`` with compact
separators and ``ensure_ascii=False``), so floats such as log-probabilities come out as vLLM
writes them. What a stream does not carry is ``null``: ``prompt_logprobs``, ``kv_transfer_params``
and ``routed_experts`` (asked for rarely, and only vLLM's whole answer has them).

An ``error`` event in the stream (vLLM sends ``data: {"error": {...}}`` when generation fails
after the response began) becomes that error as the answer, with its ``code`` as the status.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from qosgate.wire.engine_request import Route
from qosgate.wire.errors import error_json

_decode = msgspec.json.Decoder().decode
_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _dumps(obj: object) -> bytes:
    """As vLLM (Starlette's ``JSONResponse``) writes a whole answer."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class _Choice:
    """What the stream said so far about one choice (its ``index``)."""

    __slots__ = ("content", "finish_reason", "logprobs", "prompt_token_ids", "reasoning", "role",
                 "stop_reason", "token_ids", "tools")

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] | None = None  # chat: content deltas; completions: text
        self.reasoning: list[str] | None = None
        self.tools: dict[int, dict[str, Any]] = {}  # tool-call deltas merged by their index
        self.logprobs: dict[str, list[Any]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None

    def text(self, piece: object) -> None:
        if isinstance(piece, str):
            if self.content is None:
                self.content = []
            self.content.append(piece)

    def merge_logprobs(self, lp: object) -> None:
        """Each list of a ``logprobs`` object extended by the chunk's (chat: ``content``;
        completions: ``text_offset``, ``token_logprobs``, ``tokens``, ``top_logprobs``)."""
        if not isinstance(lp, dict):
            return
        if self.logprobs is None:
            self.logprobs = {}
        for key, items in lp.items():
            if isinstance(items, list):
                self.logprobs.setdefault(key, []).extend(items)
            else:
                self.logprobs.setdefault(key, [])

    def merge_tools(self, deltas: object) -> None:
        if not isinstance(deltas, list):
            return
        for d in deltas:
            if not isinstance(d, dict):
                continue
            call = self.tools.setdefault(int(d.get("index", 0)),
                                         {"id": None, "type": None, "name": None, "args": []})
            if d.get("id") is not None:
                call["id"] = d["id"]
            if d.get("type") is not None:
                call["type"] = d["type"]
            fn = d.get("function")
            if isinstance(fn, dict):
                if fn.get("name") is not None:
                    call["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    call["args"].append(fn["arguments"])

    def end(self, choice: dict[str, Any]) -> None:
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids = (self.token_ids or []) + ids
        pids = choice.get("prompt_token_ids")
        if isinstance(pids, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = pids


class StreamAssembler:
    """Collects a stream's events (``feed`` what arrives, in any pieces) and makes the whole
    answer of them (``result``). ``request``: the body sent to the engine, read only when tool
    calls were streamed (see ``_content``)."""

    def __init__(self, route: Route, request: bytes = b"") -> None:
        self.route = route
        self.request = request
        self.head: dict[str, Any] | None = None  # the first chunk's id, created, model...
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        self.fingerprint: str | None = None
        self.metrics: Any = None
        self.error: dict[str, Any] | None = None
        self.done = False
        self._rest = b""

    def feed(self, data: bytes) -> None:
        """Take the stream's next bytes; complete lines are read at once, the rest kept."""
        buf = self._rest + data if self._rest else data
        end = buf.rfind(b"\n")
        if end < 0:
            self._rest = buf
            return
        self._rest = buf[end + 1:]
        for line in buf[:end].split(b"\n"):
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, payload: bytes) -> None:
        if self.done or self.error is not None or not payload:
            return
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            ev = _decode(payload)
        except msgspec.DecodeError:
            return  # not JSON: nothing an answer could be made of
        if not isinstance(ev, dict):
            return
        if "error" in ev and "choices" not in ev:
            err = ev["error"]
            self.error = err if isinstance(err, dict) else {"message": str(err)}
            return
        if self.head is None:
            self.head = ev
        if ev.get("usage") is not None:
            self.usage = ev["usage"]
        if ev.get("system_fingerprint") is not None:
            self.fingerprint = ev["system_fingerprint"]
        if ev.get("metrics") is not None:
            self.metrics = ev["metrics"]
        chat = self.route == "chat"
        for choice in ev.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            c = self.choices.get(choice.get("index", 0))
            if c is None:
                c = self.choices[choice.get("index", 0)] = _Choice()
            if chat:
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    if delta.get("role") is not None:
                        c.role = delta["role"]
                    c.text(delta.get("content"))
                    r = delta.get("reasoning")
                    if isinstance(r, str):
                        c.reasoning = [*(c.reasoning or []), r]
                    if "tool_calls" in delta:
                        c.merge_tools(delta["tool_calls"])
            else:
                c.text(choice.get("text"))
            c.merge_logprobs(choice.get("logprobs"))
            c.end(choice)

    # ------------------------------------------------------------------ the answer
    def result_of(self, sse: bytes) -> tuple[int, bytes]:
        """``feed(sse)`` then ``result()``: a complete stream in one piece."""
        self.feed(sse)
        return self.result()

    def result(self) -> tuple[int, bytes]:
        """The status and the JSON body the client gets."""
        if self._rest:
            rest, self._rest = self._rest, b""
            if rest.startswith(b"data:"):
                self._event(rest[5:].strip())
        if self.error is not None:
            return _error_answer(self.error)
        if self.head is None:
            return _error_answer({"message": "The engine's stream ended before any answer.",
                                  "type": "upstream_error", "code": 502})
        h = self.head
        choices = [self._choice(i, self.choices[i]) for i in sorted(self.choices)]
        usage = None
        if self.usage is not None:
            u = self.usage
            usage = {"prompt_tokens": u.get("prompt_tokens", 0),
                     "total_tokens": u.get("total_tokens", 0),
                     "completion_tokens": u.get("completion_tokens", 0),
                     "prompt_tokens_details": u.get("prompt_tokens_details"),
                     "completion_tokens_details": u.get("completion_tokens_details")}
        out: dict[str, Any] = {
            "id": h.get("id"),
            "object": "chat.completion" if self.route == "chat" else "text_completion",
            "created": h.get("created"),
            "model": h.get("model"),
            "choices": choices,
            "service_tier": h.get("service_tier"),
            "system_fingerprint": self.fingerprint,
            "usage": usage,
        }
        if self.route == "chat":
            out["prompt_logprobs"] = None
            out["prompt_token_ids"] = h.get("prompt_token_ids")
            out["prompt_text"] = h.get("prompt_text")
        out["kv_transfer_params"] = None
        out["ec_transfer_params"] = None
        out["metrics"] = self.metrics
        return 200, _dumps(out)

    def _choice(self, index: int, c: _Choice) -> dict[str, Any]:
        logprobs: dict[str, list[Any]] | None = c.logprobs
        if self.route != "chat":
            if logprobs is not None:
                logprobs = {k: logprobs.get(k, []) for k in
                            ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
            return {"index": index, "text": "".join(c.content or ()), "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids, "prompt_logprobs": None,
                    "prompt_token_ids": c.prompt_token_ids, "routed_experts": None}
        message: dict[str, Any] = {
            "role": c.role or "assistant", "content": self._content(c), "refusal": None,
            "annotations": None, "audio": None, "function_call": None,
        }
        if c.tools:
            message["tool_calls"] = [
                {"id": t["id"], "type": t["type"] or "function",
                 "function": {"name": t["name"], "arguments": _arguments("".join(t["args"]))}}
                for _, t in sorted(c.tools.items())
            ]
        message["reasoning"] = "".join(c.reasoning) if c.reasoning is not None else None
        if logprobs is not None:
            logprobs = {"content": logprobs.get("content", [])}
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": c.finish_reason or "stop", "stop_reason": c.stop_reason,
                "token_ids": c.token_ids, "routed_experts": None}

    def _content(self, c: _Choice) -> str | None:
        """The message's ``content`` as vLLM's whole answer has it. The stream always opens with
        ``content: ""``; a whole answer whose tool calls came from the model's own choice
        (``tool_choice`` auto or absent) has ``null`` when the model wrote no text, while a
        forced call (a named function, ``required``) has ``""``."""
        text = "".join(c.content) if c.content is not None else None
        if text or not c.tools:
            return text
        return "" if _forced_tool_choice(self.request) else None


def _arguments(text: str) -> str:
    """A tool call's arguments as vLLM's whole answer has them: its tool parsers read the
    model's JSON and write it again (``json.dumps``, spaces after separators), while the stream
    relays the model's own text. Left as streamed if it is not JSON."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def _forced_tool_choice(request: bytes) -> bool:
    if b'"tool_choice"' not in request:
        return False
    try:
        raw = _top(request).get("tool_choice")
        choice = _decode(raw) if raw is not None else None
    except msgspec.DecodeError:
        return False
    return choice == "required" or isinstance(choice, dict)


def _error_answer(err: dict[str, Any]) -> tuple[int, bytes]:
    """An error event as the client's answer, in OpenAI's format; its ``code`` is the status
    when it is one (vLLM's is), else 500."""
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return status, error_json(str(err.get("message", "The engine failed.")),
                              str(err.get("type", "upstream_error")),
                              code if code is not None else status,
                              err.get("param") if isinstance(err.get("param"), str) else None)


def assemble(route: Route, sse: bytes, request: bytes = b"") -> tuple[int, bytes]:
    """The whole answer (status, JSON body) made of a complete stream's bytes."""
    return StreamAssembler(route, request).result_of(sse)
