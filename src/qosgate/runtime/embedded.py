"""The embedded engine of ``qosgate serve``: llama.cpp in-process, as one pausable replica.

Window and slots: the core dispatches at most ``max_window`` (the window; the config's
``engine.capacity``) requests to the replica, and those decode together. A request the core pauses
leaves the window (its slot in the core is given to the more urgent request) but keeps its llama.cpp
*slot*: its KV cells stay where they are, so resuming costs nothing. The engine therefore needs more
slots than the window -- by default twice as many (window 4, 8 slots): up to ``window`` paused
sequences keep their KV while ``window`` others run. When more are paused than that, the engine
evicts the least important paused sequence's KV (``evict_paused``) and recomputes it by prefill when
it resumes; with one KV stream per sequence that recomputation gives bit-identical logits (see
``models/llamacpp.py``), so the stream goes on exactly as it would have. Without eviction, a window
full of requests that wait for slots held by paused ones could never make progress.
"""

from __future__ import annotations

import os
from pathlib import Path

from qosgate.runtime.inprocess import InProcessEngine
from qosgate.settings import EngineSettings

DEFAULT_WINDOW = 4
# tokens one step may prefill (llama.cpp's n_batch): bounds how long a step runs, and so how long
# a realtime arrival waits for the step in flight (~0.5 s for 128 prompt tokens on 2 CPU cores)
PREFILL_CHUNK = 128
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
REPLICA_NAME = "llamacpp-0"


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def llamacpp_replica(
    *,
    model: str | Path | None = None,
    max_window: int | None = None,
    max_num_seqs: int | None = None,
    n_ctx: int = 2048,
    n_threads: int | None = None,
    served_model_name: str | None = None,
    evict_paused: bool = True,
    pausable: bool = True,
    name: str = REPLICA_NAME,
    embeddings: bool = True,
    embed_batch_tokens: int = 512,
) -> InProcessEngine:
    """Load the model (FileNotFoundError if the GGUF is missing, ImportError without
    llama-cpp-python) and wrap it as a replica that steps in a worker thread in real time."""
    from qosgate.models.llamacpp import LlamaCppEngine, default_model_path

    path = Path(model) if model is not None else default_model_path()
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    window = max_window or DEFAULT_WINDOW
    slots = max_num_seqs or 2 * window
    if slots < window:
        raise ValueError(f"max_num_seqs ({slots}) must be at least the window ({window})")
    engine = LlamaCppEngine(
        path,
        max_num_seqs=slots,
        n_ctx_per_seq=n_ctx,
        n_batch=max(PREFILL_CHUNK, slots),
        n_threads=n_threads or default_threads(),
        evict_paused=evict_paused,
    )
    if served_model_name is None:
        served_model_name = DEFAULT_MODEL_NAME if model is None else path.stem.lower()
    replica = InProcessEngine(
        engine,
        name=name,
        max_window=window,
        models=[served_model_name],
        modelled_time=False,
        text=True,
        pausable=pausable,
        max_model_len=n_ctx,
    )
    if embeddings:  # /v1/embeddings: the same model, mean-pooled (models/llama_embed.py)
        from qosgate.models.llama_embed import LlamaEmbedder

        replica.embedder = LlamaEmbedder(
            path, n_batch=embed_batch_tokens, max_seqs=64,
            n_threads=n_threads or default_threads(),
        )
    return replica


def llamacpp_from_settings(es: EngineSettings) -> InProcessEngine:
    """The replica ``qosgate serve`` builds from its ``engine`` section; the start-up check
    (``runtime/preflight.py``) builds the very same one in its child process."""
    return llamacpp_replica(
        model=es.model, max_window=es.max_window, max_num_seqs=es.max_num_seqs, n_ctx=es.n_ctx,
        n_threads=es.n_threads, served_model_name=es.served_model_name,
        evict_paused=es.evict_paused, pausable=es.pausable,
        embeddings=es.embeddings, embed_batch_tokens=es.embed_batch_tokens,
    )
