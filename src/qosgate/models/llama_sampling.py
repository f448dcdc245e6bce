"""A llama.cpp sampler chain for one sequence, from OpenAI's sampling parameters (``Sampling``)."""

from __future__ import annotations

from typing import Any

from qosgate.models.step import BadTextRequest, Sampling


def make_sampler(lib: Any, vocab: Any, history: int, sampling: Sampling, prompt: list[int]) -> Any:
    """One sampler chain per sequence, so its RNG, penalty and grammar state survive pauses
    and evictions.

    Order: logit bias, penalties and the grammar shape the logits first (greedy sampling
    included, as vLLM does), then llama.cpp's own truncation order (top-k, top-p, min-p,
    temperature) and the seeded draw. Penalties follow vLLM: ``repetition_penalty`` counts
    the prompt and the output, presence/frequency only the output, so they are two samplers
    and only the first is shown the prompt. Raises BadTextRequest if llama.cpp cannot parse
    the grammar (nothing leaks: the chain is freed). ``history``: the tokens penalties look
    back over.
    """
    params = lib.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = lib.llama_sampler_chain_init(params)
    n_vocab = int(lib.llama_vocab_n_tokens(vocab))

    def add(sampler: Any) -> None:
        lib.llama_sampler_chain_add(chain, sampler)

    if sampling.logit_bias:
        biases = (lib.llama_logit_bias * len(sampling.logit_bias))()
        for i, (token, bias) in enumerate(sampling.logit_bias):
            biases[i].token = token
            biases[i].bias = bias
        add(lib.llama_sampler_init_logit_bias(n_vocab, len(sampling.logit_bias), biases))
    if sampling.repetition_penalty != 1.0:
        rep = lib.llama_sampler_init_penalties(
            n_vocab, history, sampling.repetition_penalty, 0.0, 0.0
        )
        for token in prompt:
            lib.llama_sampler_accept(rep, token)
        add(rep)
    if sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0:
        add(lib.llama_sampler_init_penalties(
            n_vocab, history, 1.0, sampling.frequency_penalty, sampling.presence_penalty
        ))
    if sampling.grammar is not None:
        grammar = lib.llama_sampler_init_grammar(
            vocab, sampling.grammar.encode(), b"root"
        )
        if not grammar:
            lib.llama_sampler_free(chain)
            raise BadTextRequest(
                "llama.cpp could not parse the grammar built from response_format.",
                "response_format",
            )
        add(grammar)
    if sampling.temperature <= 0.0:
        add(lib.llama_sampler_init_greedy())
        return chain
    if sampling.top_k > 0:
        add(lib.llama_sampler_init_top_k(sampling.top_k))
    if sampling.top_p < 1.0:
        add(lib.llama_sampler_init_top_p(sampling.top_p, 1))
    if sampling.min_p > 0.0:
        add(lib.llama_sampler_init_min_p(sampling.min_p, 1))
    add(lib.llama_sampler_init_temp(sampling.temperature))
    seed = lib.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed & 0xFFFFFFFF
    add(lib.llama_sampler_init_dist(seed))
    return chain
