"""What a user sends through qosgate in front of vLLM, row by row: each row a call and what the
gateway does with it, compared with the same call straight to vLLM in
``tests/e2e/vllm/test_fidelity.py``. The rows are the one source of the table in
``docs/reference/compatibility.md`` (``tests/test_doc_fidelity.py`` checks that the page carries
``render()``'s table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tests.support.vllm import MAX_MODEL_LEN, MODEL

Verdict = Literal["identical", "changed", "refused"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
HI = [{"role": "user", "content": "Name three colours."}]
TOOL = {"type": "function", "function": {
    "name": "paint", "description": "Paint a wall.",
    "parameters": {"type": "object", "properties": {"colour": {"type": "string"}},
                   "required": ["colour"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "schema": {
    "type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}}}


@dataclass(frozen=True)
class Row:
    what: str  # what a user sends, in words
    method: str
    path: str
    body: dict[str, Any] | None
    verdict: Verdict
    why: str = ""  # for a change or a refusal: what and why
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": 6, "temperature": 0, **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Three primary colours are", "max_tokens": 6,
            "temperature": 0, **kw}


LONG = " ".join(["colour"] * (MAX_MODEL_LEN + 200))  # over the model's context

ROWS: tuple[Row, ...] = (
    Row("chat, whole", "POST", CHAT, chat(), "identical"),
    Row("chat, streamed with usage", "POST", CHAT,
        chat(stream=True, stream_options={"include_usage": True}), "identical", stream=True),
    Row("chat, `n: 2` sampled with a `seed`", "POST", CHAT,
        chat(n=2, temperature=0.7, seed=7), "identical"),
    Row("chat, `logprobs` with `top_logprobs`", "POST", CHAT,
        chat(logprobs=True, top_logprobs=2), "identical"),
    Row("chat, `prompt_logprobs` (whole)", "POST", CHAT, chat(prompt_logprobs=1), "identical"),
    Row("chat, `response_format` JSON schema", "POST", CHAT,
        chat(response_format=SCHEMA, max_tokens=20), "identical"),
    Row("chat, tools with `tool_choice: none`", "POST", CHAT,
        chat(tools=[TOOL], tool_choice="none"), "identical"),
    Row("chat, tools with `tool_choice: auto`", "POST", CHAT,
        chat(tools=[TOOL], tool_choice="auto"), "identical",
        "vLLM's own 400 unless started with `--enable-auto-tool-choice --tool-call-parser`"),
    Row("chat, tools with `tool_choice: required`", "POST", CHAT,
        chat(tools=[TOOL], tool_choice="required", max_tokens=30), "identical"),
    Row("chat, tools with a named function", "POST", CHAT,
        chat(tools=[TOOL], max_tokens=30,
             tool_choice={"type": "function", "function": {"name": "paint"}}), "identical"),
    Row("chat, `stop` and `seed`", "POST", CHAT, chat(stop=["\n", "."], seed=3), "identical"),
    Row("chat, `max_completion_tokens`", "POST", CHAT,
        {k: v for k, v in chat(max_completion_tokens=4).items() if k != "max_tokens"},
        "identical"),
    Row("completions, whole", "POST", COMPLETIONS, completion(), "identical"),
    Row("completions, streamed", "POST", COMPLETIONS, completion(stream=True), "identical",
        stream=True),
    Row("completions, `echo` with `logprobs`", "POST", COMPLETIONS,
        completion(echo=True, logprobs=1), "identical"),
    Row("completions, `prompt_logprobs` (whole)", "POST", COMPLETIONS,
        completion(prompt_logprobs=1), "identical"),
    Row("completions, beam search (`use_beam_search`, `n: 2`)", "POST", COMPLETIONS,
        completion(use_beam_search=True, n=2), "identical"),
    Row("Responses API, whole", "POST", RESPONSES,
        {"model": MODEL, "input": "Say hi", "max_output_tokens": 8, "temperature": 0},
        "identical"),
    Row("Responses API, streamed", "POST", RESPONSES,
        {"model": MODEL, "input": "Say hi", "instructions": "Be brief.",
         "max_output_tokens": 8, "temperature": 0, "stream": True}, "identical", stream=True),
    Row("`POST /tokenize`", "POST", "/tokenize", {"model": MODEL, "prompt": "hello world"},
        "identical"),
    Row("`POST /detokenize`", "POST", "/detokenize", {"model": MODEL, "tokens": [28120, 905]},
        "identical"),
    Row("`GET /version`", "GET", "/version", None, "identical"),
    Row("`GET /ping`", "GET", "/ping", None, "identical"),
    Row("`GET /load`", "GET", "/load", None, "identical"),
    Row("`GET /v1/models`", "GET", "/v1/models", None, "changed",
        "the models configured for the gateway, each with the engine's own card"),
    Row("a bad value (`temperature: -1`)", "POST", CHAT, chat(temperature=-1), "identical",
        "vLLM's 400, byte for byte (its numeric `code` included)"),
    Row("a prompt over the model's context", "POST", CHAT,
        chat(messages=[{"role": "user", "content": LONG}]), "identical",
        "vLLM's 400, byte for byte"),
    Row("a body `priority`", "POST", CHAT, chat(priority=5), "changed",
        "qosgate sets it to its own order in the engine's polarity, or removes it "
        "(`priority_polarity: none`)"),
    Row("a route qosgate does not serve (`POST /v1/audio/speech`)", "POST",
        "/v1/audio/speech", {"model": MODEL, "input": "hi"}, "refused",
        "404 `not_found` listing the routes served: nothing reaches an engine unseen"),
)


def render() -> str:
    """The compatibility page's table."""
    rows = ["| what a client sends | route | through qosgate |", "| --- | --- | --- |"]
    for r in ROWS:
        verdict = {"identical": "identical to vLLM", "changed": "changed",
                   "refused": "refused"}[r.verdict]
        if r.why:
            verdict += f": {r.why}"
        rows.append(f"| {r.what} | `{r.method} {r.path}` | {verdict} |")
    return "\n".join(rows) + "\n"


# members that name one answer, not what it says: compared as present, not by value
_NAMES = frozenset(("id", "created", "created_at", "item_id"))


def anonymous(doc: Any) -> Any:
    """``doc`` with the values that differ from one answer to the next (ids, times) blanked."""
    if isinstance(doc, dict):
        return {k: (None if k in _NAMES else anonymous(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [anonymous(v) for v in doc]
    return doc
