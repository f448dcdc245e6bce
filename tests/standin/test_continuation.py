"""A stream continued from the ids it delivered is exact on the stand-in, as on greedy vLLM:
n tokens at once, or k and then n - k from the prompt's ids plus those k ids, give the same ids
and the same text (the continuation goes to /v1/completions with a prompt of token ids)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.standin import MODEL, Answer, post_all

N = 9
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _streamed(answer: Answer) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, text) of a stream asked with ``return_token_ids``."""
    prompt: list[int] = []
    ids: list[int] = []
    text = ""
    for chunk in answer.chunks():
        if chunk.get("prompt_token_ids"):
            prompt = chunk["prompt_token_ids"]
        for choice in chunk["choices"]:
            if choice.get("prompt_token_ids"):
                prompt = choice["prompt_token_ids"]
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            ids += choice.get("token_ids") or []
    return prompt, ids, text


def _body(route: str, first: Any, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
                            "return_token_ids": True}
    if route == "chat":
        return "/v1/chat/completions", {**body, "messages": first}
    return "/v1/completions", {**body, "prompt": first}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_continuation_from_delivered_ids_is_exact(route: str) -> None:
    first = MESSAGES if route == "chat" else "The sea is"
    splits = (1, 2, 5, N - 1)
    answers = post_all([_body(route, first, N)] + [_body(route, first, k) for k in splits])
    prompt, whole_ids, whole_text = _streamed(answers[0])
    assert len(whole_ids) == N
    continuations = []
    for k, answer in zip(splits, answers[1:], strict=True):
        head_prompt, head_ids, _ = _streamed(answer)
        assert head_prompt == prompt
        continuations.append(_body("completions", prompt + head_ids, N - k))
    for k, answer, cont in zip(splits, answers[1:], post_all(continuations), strict=True):
        _, head_ids, head_text = _streamed(answer)
        _, tail_ids, tail_text = _streamed(cont)
        assert head_ids + tail_ids == whole_ids, k
        assert head_text + tail_text == whole_text, k
