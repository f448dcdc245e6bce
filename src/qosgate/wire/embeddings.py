"""OpenAI's embeddings wire format: the request read and checked, the response written.

Shared by the gateway (``POST /v1/embeddings``), the engines that serve a batch of them (their
answer to each client: ``runtime/embeddings.py``) and the stand-in. ``input`` is a string, a
list of strings, a token array (list of ints) or a list of token arrays; ``encoding_format`` is
``float`` (default) or ``base64`` (little-endian float32, as OpenAI's); ``dimensions``
(optional) truncates and re-normalizes.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

Inputs = list[str] | list[list[int]]

class BadEmbeddings(ValueError):
    def __init__(self, message: str, param: str | None, code: str = "invalid_body") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True)
class EmbeddingsBody:
    model: str | None
    inputs: Inputs
    encoding_format: str
    dimensions: int | None
    user: str | None
    priority: int | None
    has_priority: bool
    latency_budget_ms: float | None
    task_type: str | None
    qos_class: str | None
    tokens: int  # estimated: characters / 4 for text, the count for token arrays


def estimate_tokens(item: str | list[int]) -> int:
    return len(item) if isinstance(item, list) else max(1, (len(item) + 3) // 4)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_embeddings(body: bytes, max_inputs: int = 2048,
                     max_input_tokens: int = 8192) -> EmbeddingsBody:
    """Read and check a ``/v1/embeddings`` body; ``BadEmbeddings`` names the member at fault."""
    try:
        d = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise BadEmbeddings("The body is not valid JSON.", None, "invalid_json") from None
    if not isinstance(d, dict):
        raise BadEmbeddings("The body must be a JSON object.", None, "invalid_json")
    if "input" not in d:
        raise BadEmbeddings("'input' is required.", "input")
    raw = d["input"]
    inputs: Inputs
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise BadEmbeddings("'input' must not be an empty list.", "input")
        if all(isinstance(x, str) for x in raw):
            inputs = list(raw)
        elif all(_is_int(x) for x in raw):
            inputs = [list(raw)]
        elif all(isinstance(x, list) for x in raw):
            for i, arr in enumerate(raw):
                if not arr:
                    raise BadEmbeddings(f"'input[{i}]' must not be an empty token array.",
                                        "input")
                if not all(_is_int(x) and x >= 0 for x in arr):
                    raise BadEmbeddings(f"'input[{i}]' must be an array of non-negative "
                                        "integer token ids.", "input")
            inputs = [list(a) for a in raw]
        else:
            raise BadEmbeddings("'input' must be a string, an array of strings, an array of "
                                "token ids or an array of token arrays.", "input")
    else:
        raise BadEmbeddings("'input' must be a string, an array of strings, an array of token "
                            f"ids or an array of token arrays, not {type(raw).__name__}.",
                            "input")
    if len(inputs) > max_inputs:
        raise BadEmbeddings(f"'input' has {len(inputs)} items, over the limit of {max_inputs}.",
                            "input")
    total = 0
    items: list[str | list[int]] = list(inputs)
    for i, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise BadEmbeddings(f"'input[{i}]' must not be an empty string.", "input")
        if isinstance(item, list) and not all(_is_int(x) and x >= 0 for x in item):
            raise BadEmbeddings("'input' must be an array of non-negative integer token ids.",
                                "input")
        n = estimate_tokens(item)
        if n > max_input_tokens:
            raise BadEmbeddings(
                f"'input[{i}]' is about {n} tokens (text estimated as characters / 4), over "
                f"the limit of {max_input_tokens} tokens per input.", "input")
        total += n
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise BadEmbeddings("'model' must be a string.", "model")
    fmt = d.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise BadEmbeddings("'encoding_format' must be 'float' or 'base64'.", "encoding_format")
    dims = d.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise BadEmbeddings("'dimensions' must be a positive integer.", "dimensions")
    user = d.get("user")
    if user is not None and not isinstance(user, str):
        raise BadEmbeddings("'user' must be a string.", "user")
    prio = d.get("priority")
    if prio is not None and not _is_int(prio):
        raise BadEmbeddings("'priority' must be an integer.", "priority", "invalid_priority")
    budget = d.get("latency_budget_ms")
    if budget is not None and (not isinstance(budget, int | float) or isinstance(budget, bool)):
        raise BadEmbeddings("'latency_budget_ms' must be a number.", "latency_budget_ms")
    for k in ("task_type", "qos_class"):
        if d.get(k) is not None and not isinstance(d[k], str):
            raise BadEmbeddings(f"'{k}' must be a string.", k)
    return EmbeddingsBody(
        model=model, inputs=inputs, encoding_format=fmt, dimensions=dims, user=user,
        priority=prio, has_priority="priority" in d,
        latency_budget_ms=float(budget) if budget is not None else None,
        task_type=d.get("task_type"), qos_class=d.get("qos_class"), tokens=total,
    )


def shape(vec: Sequence[float], dimensions: int | None) -> list[float]:
    """``dimensions``: the first that many, re-normalized to unit length."""
    if dimensions is None or dimensions >= len(vec):
        return list(vec)
    v = list(vec[:dimensions])
    n = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / n for x in v]


def encode_vector(vec: Sequence[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return [float(x) for x in vec]


def response(model: str, vectors: Sequence[Sequence[float]], fmt: str, prompt_tokens: int,
             dimensions: int | None = None) -> bytes:
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": i, "embedding": encode_vector(shape(v, dimensions), fmt)}
        for i, v in enumerate(vectors)
    ]
    return msgspec.json.encode({
        "object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })


def pooled(v: object) -> list[float]:
    """An upstream's embedding as one vector: as it is, or -- token-level embeddings (a list of
    vectors, as llama.cpp's server gives for a model without pooling) -- mean-pooled and
    L2-normalized, as the in-process engine pools. ValueError for anything else."""
    if isinstance(v, list) and v and all(isinstance(x, int | float) for x in v):
        return [float(x) for x in v]
    if isinstance(v, list) and v and all(isinstance(r, list) and r for r in v):
        n = len(v[0])
        if not all(len(r) == n for r in v):
            raise ValueError("token embeddings of different sizes")
        mean = [sum(float(r[i]) for r in v) / len(v) for i in range(n)]
        norm = math.sqrt(sum(x * x for x in mean)) or 1.0
        return [x / norm for x in mean]
    raise ValueError("an embedding is neither a vector nor a list of token vectors")


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` (largest remainders): each client's share of
    an upstream's usage when it reports only the batch's total."""
    s = sum(weights)
    if s <= 0:
        return [0 for _ in weights]
    exact = [total * w / s for w in weights]
    out = [int(x) for x in exact]
    left = total - sum(out)
    order = sorted(range(len(weights)), key=lambda i: exact[i] - out[i], reverse=True)
    for i in order[:left]:
        out[i] += 1
    return out


def text_vector(item: str | list[int], dim: int) -> list[float]:
    """A deterministic unit vector from the input (the stand-in's "model")."""
    key = item.encode() if isinstance(item, str) else struct.pack(f"<{len(item)}I", *item)
    out: list[float] = []
    counter = 0
    while len(out) < dim:
        h = hashlib.blake2b(key + counter.to_bytes(4, "little"), digest_size=64).digest()
        out.extend((b - 127.5) / 127.5 for b in h)
        counter += 1
    v = out[:dim]
    n = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / n for x in v]
