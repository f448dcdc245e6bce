"""Every request member the embedded engine is sent is honoured or refused, never silently
ignored (the list: ``wire/textparams.py``), through ``qosgate serve`` and the ``openai`` client.

Honoured: ``response_format`` (JSON mode, JSON schemas, by a llama.cpp grammar), ``logit_bias``,
the penalties, ``top_k``, ``min_p``; an absent cap runs to the end of the context. Refused with a
400 naming the member: what the engine cannot do, a bad value (vLLM's checks and messages), and a
prompt + ``max_tokens`` over the context (vLLM's message). A stream never ends inside a UTF-8
character: a token that ends mid-character waits for the one that completes it, and bytes left
incomplete at the end are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.llama import MODEL, MODEL_PATH, Serve

pytestmark = pytest.mark.e2e

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]
EMOJIS = [{"role": "user", "content": "Reply with three emojis."}]  # greedy: 🌟 in 3 tokens each


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("params") / "serve.log")  # the default 2,048 context
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(serve: Serve) -> Any:
    """The ``openai`` client (typed Any: these tests send members its stubs do not list)."""
    return serve.client()


@pytest.fixture(scope="module")
def vocab() -> Any:
    """llama-cpp-python's own tokenizer of the served model (token ids for logit_bias)."""
    from llama_cpp import Llama

    return Llama(str(MODEL_PATH), vocab_only=True, verbose=False)


def one_token(vocab: Any, text: str) -> int:
    ids = vocab.tokenize(text.encode(), add_bos=False, special=False)
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def chat(client: Any, messages: Any = ASK_PERSON, **kw: Any) -> str:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    r = client.chat.completions.create(model=MODEL, messages=messages, **kw)
    return str(r.choices[0].message.content or "")


# ---------------------------------------------------------------------- honoured
def test_json_schema_gives_json_that_validates(client: Any) -> None:
    rf: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    prose = chat(client, max_tokens=120)
    assert not prose.lstrip().startswith("{")  # unconstrained, the model writes prose first
    for temperature in (0.0, 1.0):
        text = chat(client, max_tokens=120, response_format=rf, temperature=temperature, seed=3)
        value = json.loads(text)
        assert set(value) == {"name", "age", "city"}, value
        assert isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
        assert value["city"] in ("Paris", "Rome", "Oslo")
    streamed = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, max_tokens=120, temperature=0, response_format=rf,
        stream=True,
    )
    parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(parts) == chat(client, max_tokens=120, response_format=rf)


def test_json_object_gives_a_json_object(client: Any) -> None:
    text = chat(client, max_tokens=120, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict), text
    t = client.completions.create(
        model=MODEL, prompt="A person, as JSON:", max_tokens=120, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(t.choices[0].text), dict), t.choices[0].text


def test_logit_bias_bans_and_forces_tokens(client: Any, vocab: Any) -> None:
    prompt = "The three primary colors are red,"

    def complete(n: int, **kw: Any) -> str:
        t = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                      **kw)
        return str(t.choices[0].text)

    first = complete(1)
    banned = one_token(vocab, first)
    assert complete(1, logit_bias={str(banned): -100}) != first
    forced = one_token(vocab, " banana")
    assert complete(3, logit_bias={str(forced): 100}) == " banana" * 3


def test_penalties_top_k_and_min_p_take_effect(client: Any) -> None:
    greedy = chat(client, EMOJIS, max_tokens=12)
    assert greedy == "🌟" * 4  # the model repeats itself...
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"extra_body": {"repetition_penalty": 2.0}}):
        assert chat(client, EMOJIS, max_tokens=12, **penalty) != greedy, penalty  # ...not here
    joke = [{"role": "user", "content": "Tell me a joke."}]
    plain = chat(client, joke)
    sampled = chat(client, joke, temperature=1.0, seed=5)
    assert sampled != plain
    # keeping only the most likely token makes sampling greedy
    assert chat(client, joke, temperature=1.0, seed=5, extra_body={"top_k": 1}) == plain
    assert chat(client, joke, temperature=1.0, seed=5, extra_body={"min_p": 1.0}) == plain


# ---------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"echo": True}, "echo"),
        ("completions", {"suffix": " and that is all."}, "suffix"),
        ("completions", {"best_of": 2}, "best_of"),
        ("completions", {"logprobs": 2}, "logprobs"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"extra_body": {"min_tokens": 8}}, "min_tokens"),
        ("chat", {"extra_body": {"guided_json": PERSON}}, "guided_json"),
        # bad values
        ("chat", {"response_format": {"type": "bogus"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
         "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": [1]}}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {
                "type": "object", "properties": {"age": {"type": "integer", "minimum": 18}}}}}},
         "response_format"),  # a keyword the grammar cannot enforce: not enforced in part
        ("chat", {"extra_body": {"top_k": -5}}, "top_k"),
        ("chat", {"extra_body": {"min_p": 1.5}}, "min_p"),
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ("chat", {"logit_bias": {"blue": 5}}, "logit_bias"),
        ("chat", {"logit_bias": {"999999": 5}}, "logit_bias"),
        ("completions", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ],
)
def test_what_the_engine_cannot_do_is_a_400_naming_the_member(
    client: Any, route: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            client.chat.completions.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}], **body
            )
        else:
            client.completions.create(model=MODEL, max_tokens=4, prompt="hi", **body)
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param, err.value


def test_values_that_ask_for_nothing_are_accepted(client: Any) -> None:
    t = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, echo=False, best_of=1, logprobs=None,
        suffix=None, stream_options=None, extra_body={"top_k": -1, "min_tokens": 0},
    )
    assert t.choices[0].finish_reason in ("stop", "length")
    assert chat(client, max_tokens=2, response_format={"type": "text"}, tool_choice="none")


@pytest.mark.parametrize("cap", ["max_tokens", "max_completion_tokens"])
def test_prompt_plus_cap_over_the_context_is_a_400(
    client: Any, vocab: Any, cap: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], **{cap: 4000}
        )
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == cap
    msg = str(err.value.body.get("message"))
    assert msg.startswith("This model's maximum context length is 2048 tokens. However, you "
                          "requested "), msg
    assert "in the messages, 4000 in the completion). Please reduce the length of the messages" \
        " or completion." in msg
    # the largest cap that fits is served (the end of sequence forced: one token)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=0)
    assert r.usage is not None
    fits = 2048 - r.usage.prompt_tokens
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
        logit_bias={str(vocab.token_eos()): 100}, **{cap: fits})
    assert r.choices[0].finish_reason == "stop" and r.usage is not None
    assert r.usage.completion_tokens == 1


# ---------------------------------------------------------------------- UTF-8
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 7])
def test_a_stream_never_splits_or_mangles_a_character(client: Any, max_tokens: int) -> None:
    """🌟 is three tokens here: a cap that ends inside it drops the incomplete bytes (streamed
    or not), and no chunk carries part of a character."""
    chunks = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model=MODEL, messages=EMOJIS, max_tokens=max_tokens, temperature=0, stream=True)
        if c.choices and c.choices[0].delta.content
    ]
    whole = chat(client, EMOJIS, max_tokens=max_tokens)
    assert chunks == ["🌟"] * (max_tokens // 3)
    assert whole == "".join(chunks)
