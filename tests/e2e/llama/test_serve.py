"""``qosgate serve`` with no engine flags answers with the real model (llama.cpp, SmolLM2-135M).

Real text through the official ``openai`` client, chat and completions, streaming and not; usage
counted by the model's own tokenizer; OpenAI's sampling parameters; 400s for what the model cannot
do; and the start-up error when the GGUF is missing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from qosgate.models.llamacpp import LlamaCppEngine
from qosgate.models.step import Sampling, SeqSpec
from tests.support.llama import MODEL, MODEL_PATH, Serve
from tests.support.processes import QOSGATE

pytestmark = pytest.mark.e2e

QUESTION = "Name three primary colors."


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("serve") / "serve.log")  # only --port and --log-level
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    """llama-cpp-python's own tokenizer and chat formatter: an independent count."""
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    m = Llama(str(MODEL_PATH), vocab_only=True, verbose=False)
    fmt = Jinja2ChatFormatter(
        m.metadata["tokenizer.chat_template"],
        eos_token=m._model.token_get_text(m.token_eos()),
        bos_token=m._model.token_get_text(m.token_bos()),
    )

    class Vocab:
        def chat_tokens(self, messages: Any) -> int:
            prompt = fmt(messages=messages).prompt
            return len(m.tokenize(prompt.encode(), add_bos=False, special=True))

        def prompt_tokens(self, text: str) -> int:
            return len(m.tokenize(text.encode(), add_bos=True, special=True))

    yield Vocab()


def direct(spec: SeqSpec) -> tuple[str, int, int]:
    """The same generation straight on a fresh engine with the gateway's context size:
    (text, prompt tokens, completion tokens)."""
    with LlamaCppEngine(MODEL_PATH, max_num_seqs=1, n_ctx_per_seq=2048, n_threads=2) as e:
        e.add(spec)
        text = []
        while True:
            r = e.step()
            text += [t.text for t in r.tokens]
            if r.finished:
                fin = r.finished[0]
                return "".join(text), fin.prompt_tokens, fin.completion_tokens


def test_default_engine_is_llamacpp_with_the_shipped_model(serve: Serve) -> None:
    log = serve.log.read_text()
    assert "llama.cpp in-process" in log and "SmolLM2-135M-Instruct" in log, log
    # what llama.cpp was built to use, and the start-up check (runtime/preflight.py) passed
    assert re.search(r"llama\.cpp: CPU : .*; start-up check passed: a child process decoded "
                     r"\d+ tokens in", log), log
    assert [m.id for m in serve.client().models.list().data] == [MODEL]


def test_chat_real_text_streaming_and_not_usage_from_the_tokenizer(
    serve: Serve, vocab: Any
) -> None:
    c = serve.client()
    messages: Any = [{"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    text = r.choices[0].message.content or ""
    assert r.choices[0].message.role == "assistant"
    assert sum(ch.isalpha() for ch in text) > 10, text
    assert r.usage is not None
    assert r.usage.prompt_tokens == vocab.chat_tokens(messages)
    ref = direct(SeqSpec("ref", 0, 32, messages=messages, sampling=Sampling(temperature=0.0)))
    assert (text, r.usage.prompt_tokens, r.usage.completion_tokens) == ref
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if ref[2] == 32 else "stop")

    chunks = list(c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0,
        stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == r.choices[0].finish_reason and set(finishes[:-1]) == {None}


def test_completions_prompt_stop_and_usage(serve: Serve, vocab: Any) -> None:
    c = serve.client()
    prompt = "The three primary colors are red,"
    t = c.completions.create(model=MODEL, prompt=[prompt], max_tokens=24, temperature=0,
                             stop=["."])
    text = t.choices[0].text
    assert t.usage is not None and t.usage.prompt_tokens == vocab.prompt_tokens(prompt)
    ref = direct(SeqSpec("ref", 0, 24, prompt=prompt,
                         sampling=Sampling(temperature=0.0, stop=(".",))))
    assert (text, t.usage.prompt_tokens, t.usage.completion_tokens) == ref
    assert "." not in text and text.strip()
    assert t.choices[0].finish_reason == "stop"
    parts = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      stop=["."], stream=True))
    assert "".join(p.choices[0].text for p in parts) == text
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(serve: Serve) -> None:
    c = serve.client()

    def once() -> str:
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}],
            max_tokens=16, temperature=1.0, top_p=0.9, seed=42,
        )
        return r.choices[0].message.content or ""

    first = once()
    assert first and once() == first


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {"temperature": 2.5}, "temperature"),
        ("chat", {"temperature": -0.1}, "temperature"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("chat", {"n": 2}, "n"),
        ("chat", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
        ("completions", {"prompt": [1, 2, 3]}, "prompt"),
        ("completions", {"prompt": ["one", "two"]}, "prompt"),
    ],
)
def test_what_the_model_cannot_do_is_a_400(
    serve: Serve, route: str, body: dict[str, Any], param: str
) -> None:
    c = serve.client()
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            args: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **body}
            c.chat.completions.create(model=MODEL, max_tokens=4, **args)
        else:
            c.completions.create(model=MODEL, max_tokens=4, **body)
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param


def test_what_the_model_cannot_do_is_refused_before_admission(serve: Serve) -> None:
    """It never queues: it is counted as refused before the scheduler (class "none"), not as a
    request that the engine turned away after it waited for a slot."""
    with pytest.raises(openai.BadRequestError):
        serve.client().chat.completions.create(
            model=MODEL, max_tokens=4, temperature=7.0,
            messages=[{"role": "user", "content": "hi"}],
        )
    with urllib.request.urlopen(serve.url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    refused = [
        line for line in metrics.splitlines()
        if line.startswith("qosgate_requests_total{") and 'reason="invalid_body"' in line
    ]
    assert refused and all('class="none"' in line for line in refused), refused
    assert 'reason="engine_rejected"' not in metrics


def test_content_parts_of_text_are_joined(serve: Serve) -> None:
    r = serve.client().chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )
    assert r.choices[0].message.content


def test_prompt_longer_than_the_context_is_a_400(serve: Serve) -> None:
    """vLLM's words; without max_tokens the prompt alone must leave room for one token."""
    client: Any = serve.client()
    for cap in ({"max_tokens": 4}, {}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="word " * 2500, **cap)
        assert isinstance(err.value.body, dict) and err.value.body.get("param") == (
            "max_tokens" if cap else "prompt")
        assert "This model's maximum context length is 2048 tokens." in str(err.value)


def test_missing_gguf_is_a_clear_start_up_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    p = subprocess.run(
        [sys.executable, "-m", "qosgate.cli", "serve", "--port", "0", "--model", str(missing)],
        capture_output=True, text=True, timeout=60, env={"COLUMNS": "300", "PATH": ""},
    )
    assert p.returncode == 2
    assert "model file not found" in p.stdout and str(missing) in p.stdout, p.stdout + p.stderr


def test_sim_engine_stays_available_by_flag(tmp_path: Path) -> None:
    s = Serve(tmp_path / "sim.log", "--engine", "sim", "--sim-time-scale", "0.01")
    try:
        c = s.client()
        assert [m.id for m in c.models.list().data] == ["qosgate-sim"]
        r = c.completions.create(model="qosgate-sim", prompt="abc", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens == 3
    finally:
        assert s.stop() == 0


def test_replay_says_what_the_embedded_engine_does_not_take_and_runs_without_it(
    serve: Serve, tmp_path: Path
) -> None:
    """``qosgate replay`` against the embedded engine: token-id prompts and ``ignore_eos`` (the
    defaults) are refused with a 400 naming the field, and the report counts them by field;
    with ``--text-prompts --no-ignore-eos`` every request is served."""
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "name: eos\npolicies: [qos]\nduration_s: 1\narrivals: {process: poisson, rate: 1}\n"
        "lengths: {prompt: {dist: constant, value: 16}, output: {dist: constant, value: 8}}\n"
        "mix: [{share: 1, class: api}]\n"
        "tpot_slo_ms: {realtime: 200, api: 200, batch: 1000, offline: 1000}\n")
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"t": 0, "prompt_tokens": 16, "output_tokens": 8}\n' * 2)

    def replay(*extra: str) -> dict[str, Any]:
        proc = subprocess.run(
            [*QOSGATE, "replay", serve.url, "--scenario", str(scenario), "--requests",
             str(requests), "--json-only", "--max-seconds", "60", *extra],
            capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        doc: dict[str, Any] = json.loads(proc.stdout)
        return doc

    for extra, field in (((), "ignore_eos"), (("--no-ignore-eos",), "prompt")):
        refused = replay(*extra)
        assert refused["runs"][0]["outcomes"] == {"failed": 2}
        assert refused["replay"]["unsupported_fields"] == {field: 2}
    served = replay("--text-prompts", "--no-ignore-eos")
    assert served["runs"][0]["outcomes"] == {"completed": 2}
    assert served["replay"]["unsupported_fields"] == {} and not served["replay"]["ignore_eos"]
    assert served["replay"]["short_outputs"] <= 2  # the model may end before 8 tokens
