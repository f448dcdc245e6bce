"""What the embedded engine does with each request member: the one list, read by the request
parser (``textreq.py``) and documented in docs/engine.md (a test keeps the two equal).

``honoured``: the engine does what the member asks (``textreq.py`` checks its value).
``refused``: the engine cannot do it, so a request that asks for it is a 400 naming it, instead of
an answer that silently is not what was asked. A refused member may still be sent with a value
that asks for nothing (``null``, ``false``, ``0``, an empty list, or the member's own listed
values such as ``best_of: 1``).
``ignored``: read by the gateway, or without effect on a single text answer; members not listed
at all are ignored too, as OpenAI-compatible servers (vLLM) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["honoured", "refused", "ignored"]

# JSON values that ask for nothing (compared with all whitespace removed)
NOTHING = frozenset((b"", b"null", b"false", b"0", b"[]"))


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    status: Status
    note: str  # honoured: what it does; refused: what it would need; ignored: why
    also_nothing: frozenset[bytes] = frozenset()  # refused: more values that ask for nothing

    def asks_nothing(self, raw: bytes) -> bool:
        """Whether the raw JSON value ``raw`` leaves the member's feature off."""
        v = b"".join(raw.split())
        return v in NOTHING or v in self.also_nothing


def _p(name: str, status: Status, note: str, *nothing: bytes) -> Param:
    return Param(name, status, note, frozenset(nothing))


PARAMS: tuple[Param, ...] = (
    _p("messages", "honoured", "chat: rendered with the model's own chat template; text only"),
    _p("prompt", "honoured", "completions: a string or a list of one string"),
    _p("max_tokens", "honoured",
       "output cap; prompt + cap over the context is a 400; absent: the rest of the context"),
    _p("max_completion_tokens", "honoured", "as max_tokens, and wins over it"),
    _p("temperature", "honoured", "in [0, 2], default 1; 0 is greedy"),
    _p("top_p", "honoured", "in (0, 1]"),
    _p("top_k", "honoured", "0 or -1 is off, else at least 1"),
    _p("min_p", "honoured", "in [0, 1]"),
    _p("seed", "honoured", "seeded sampling reproduces exactly"),
    _p("stop", "honoured", "a string or up to 4; the stop string is not returned"),
    _p("n", "honoured", "1 only"),
    _p("stream", "honoured", "server-sent events"),
    _p("stream_options", "honoured", "include_usage; a 400 without stream: true (as vLLM)"),
    _p("response_format", "honoured",
       "text, json_object, json_schema: enforced by a llama.cpp grammar"),
    _p("logit_bias", "honoured", "token id -> bias, clamped to [-100, 100]"),
    _p("presence_penalty", "honoured", "in [-2, 2], on the generated tokens"),
    _p("frequency_penalty", "honoured", "in [-2, 2], on the generated tokens"),
    _p("repetition_penalty", "honoured", "> 0, on the prompt and the generated tokens"),
    _p("tools", "refused", "tool calling"),
    _p("tool_choice", "refused", "tool calling", b'"none"'),
    _p("functions", "refused", "function calling"),
    _p("function_call", "refused", "function calling", b'"none"'),
    _p("logprobs", "refused", "log probabilities"),
    _p("top_logprobs", "refused", "log probabilities"),
    _p("prompt_logprobs", "refused", "log probabilities"),
    _p("echo", "refused", "returning the prompt with the completion"),
    _p("suffix", "refused", "fill-in-the-middle", b'""'),
    _p("best_of", "refused", "generating several completions", b"1"),
    _p("audio", "refused", "audio output"),
    _p("modalities", "refused", "output other than text", b'["text"]'),
    _p("prediction", "refused", "predicted outputs"),
    _p("min_tokens", "refused", "a minimum output length"),
    _p("ignore_eos", "refused", "generating past the end of sequence"),
    _p("stop_token_ids", "refused", "stop tokens by id"),
    _p("include_stop_str_in_output", "refused", "returning the stop string"),
    _p("bad_words", "refused", "banned words"),
    _p("allowed_token_ids", "refused", "an allowed-token list"),
    _p("structured_outputs", "refused", "vLLM's structured outputs; use response_format"),
    _p("guided_json", "refused", "vLLM's guided decoding; use response_format"),
    _p("guided_regex", "refused", "vLLM's guided decoding"),
    _p("guided_choice", "refused", "vLLM's guided decoding"),
    _p("guided_grammar", "refused", "vLLM's guided decoding"),
    _p("model", "ignored", "the gateway routes on it"),
    _p("priority", "ignored", "read by the gateway's scheduler"),
    _p("qos_class", "ignored", "read by the gateway's scheduler"),
    _p("task_type", "ignored", "read by the gateway's scheduler"),
    _p("latency_budget_ms", "ignored", "read by the gateway's scheduler"),
    _p("user", "ignored", "an end-user id; nothing to do with the answer"),
    _p("metadata", "ignored", "nothing is stored"),
    _p("store", "ignored", "nothing is stored"),
    _p("service_tier", "ignored", "the gateway's QoS classes play that part"),
    _p("parallel_tool_calls", "ignored", "no tools (tools is refused)"),
    _p("reasoning_effort", "ignored", "the model does not reason before answering"),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
REFUSED: tuple[Param, ...] = tuple(p for p in PARAMS if p.status == "refused")
