"""What the embedded engine does with each request member: the one list, read by the request
parser (``textreq.py``) and documented in docs/guides/engine.md (a test keeps the two equal).

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
    note: str  # honoured: what it does; refused: why (ends the 400's message); ignored: why
    nothing: frozenset[bytes] = NOTHING  # refused: the values that ask for nothing

    def asks_nothing(self, raw: bytes) -> bool:
        """Whether the raw JSON value ``raw`` leaves the member's feature off."""
        return b"".join(raw.split()) in self.nothing


def _p(
    name: str, status: Status, note: str, *also: bytes, base: frozenset[bytes] = NOTHING
) -> Param:
    return Param(name, status, note, base | frozenset(also))


# a completions ``logprobs`` of 0 still asks for the chosen tokens' log probabilities
_ABSENT = frozenset((b"", b"null", b"false"))


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
    _p("tools", "refused", "no tool calling"),
    _p("tool_choice", "refused", "no tool calling", b'"none"'),
    _p("functions", "refused", "no function calling"),
    _p("function_call", "refused", "no function calling", b'"none"'),
    _p("logprobs", "refused", "no log probabilities", base=_ABSENT),
    _p("top_logprobs", "refused", "no log probabilities"),
    _p("prompt_logprobs", "refused", "no log probabilities"),
    _p("echo", "refused", "the prompt is not returned with the completion"),
    _p("suffix", "refused", "no fill-in-the-middle", b'""'),
    _p("best_of", "refused", "one completion is generated", b"1"),
    _p("audio", "refused", "text output only"),
    _p("modalities", "refused", "text output only", b'["text"]'),
    _p("prediction", "refused", "no predicted outputs"),
    _p("min_tokens", "refused", "no minimum output length"),
    _p("ignore_eos", "refused", "the end of sequence always ends the answer"),
    _p("stop_token_ids", "refused", "no stop tokens by id"),
    _p("include_stop_str_in_output", "refused", "the stop string is never returned"),
    _p("bad_words", "refused", "no banned words"),
    _p("allowed_token_ids", "refused", "no allowed-token list"),
    _p("structured_outputs", "refused", "use response_format"),
    _p("guided_json", "refused", "use response_format"),
    _p("guided_regex", "refused", "use response_format"),
    _p("guided_choice", "refused", "use response_format"),
    _p("guided_grammar", "refused", "use response_format"),
    _p("web_search_options", "refused", "no web search", b"{}"),
    _p("verbosity", "refused", "no control of the answer's length but max_tokens",
       b'"medium"'),
    _p("model", "ignored", "the gateway routes on it"),
    _p("priority", "ignored", "read by the gateway's scheduler"),
    _p("qos_class", "ignored", "read by the gateway's scheduler"),
    _p("task_type", "ignored", "read by the gateway's scheduler"),
    _p("latency_budget_ms", "ignored", "read by the gateway's scheduler"),
    _p("user", "ignored", "an end-user id; nothing to do with the answer"),
    _p("safety_identifier", "ignored", "an end-user id; nothing to do with the answer"),
    _p("prompt_cache_key", "ignored", "a cache hint; the answer does not depend on it"),
    _p("prompt_cache_retention", "ignored", "a cache hint; the answer does not depend on it"),
    _p("metadata", "ignored", "nothing is stored"),
    _p("store", "ignored", "nothing is stored"),
    _p("service_tier", "ignored", "the gateway's QoS classes play that part"),
    _p("parallel_tool_calls", "ignored", "no tools (tools is refused)"),
    _p("reasoning_effort", "ignored", "the model does not reason before answering"),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
REFUSED: tuple[Param, ...] = tuple(p for p in PARAMS if p.status == "refused")
