"""The engine's prefill rule that keeps realtime TTFT short: a more urgent prompt prefills
without less urgent prompts in its step (decoding sequences still take their token)."""

from __future__ import annotations

from qosgate.models.llamacpp import LlamaCppEngine
from qosgate.models.step import Sampling, SeqSpec
from tests.support.llama import MODEL_PATH

GREEDY = Sampling(temperature=0.0)
LONG = "Summarize: " + "The history of computing spans many decades. " * 6


def test_urgent_prompt_prefills_alone_and_less_urgent_ones_resume_after() -> None:
    with LlamaCppEngine(MODEL_PATH, max_num_seqs=3, n_ctx_per_seq=256, n_batch=16,
                        n_threads=2) as e:
        e.add(SeqSpec("dec", 0, 8, prompt="Hello", sampling=GREEDY, engine_priority=3))
        e.step()  # "dec" prefilled (2 tokens) and decoding from now on
        e.add(SeqSpec("low", 0, 4, prompt=LONG, sampling=GREEDY, engine_priority=3))
        e.step()
        low = e._seqs["low"]
        assert 0 < low.n_past < len(low.tokens)  # mid-prefill, chunked by n_batch
        e.add(SeqSpec("rt", 0, 4, prompt="Hi there, how are", sampling=GREEDY,
                      engine_priority=0))
        before_low, before_dec = low.n_past, e._seqs["dec"].n_past
        r = e.step()
        assert low.n_past == before_low  # the less urgent prompt waited
        assert e._seqs["dec"].n_past == before_dec + 1  # decoding went on
        assert {t.seq_id for t in r.tokens} == {"dec", "rt"}  # "rt" got its first token
        e.step()
        assert low.n_past > before_low  # and goes on once no more urgent prompt is left
