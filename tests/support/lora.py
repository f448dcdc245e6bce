"""LoRA adapters for SmolLM2-135M made here, so that no test downloads one.

An adapter is random low-rank weights in PEFT's layout (``adapter_config.json`` beside
``adapter_model.safetensors``), seeded so that the same name gives the same weights on every run.
The safetensors file is written by hand (an 8-byte header length, a JSON header, the raw
little-endian tensors): the format is that small, and the test environment need not carry the
``safetensors`` package for it.
"""

from __future__ import annotations

import json
import random
import struct
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.httpclient import http
from tests.support.waiting import wait_until

# SmolLM2-135M's shapes: 30 layers, hidden 576, 9 query heads and 3 KV heads of 64
LAYERS = 30
HIDDEN = 576
KV_WIDTH = 3 * 64
TARGETS = {"q_proj": HIDDEN, "v_proj": KV_WIDTH}  # module: its output width

RANK = 8


def _tensor(rng: random.Random, rows: int, cols: int, scale: float) -> bytes:
    values = array("f", (rng.gauss(0.0, scale) for _ in range(rows * cols)))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def _safetensors(tensors: dict[str, tuple[tuple[int, int], bytes]]) -> bytes:
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(d for _, d in tensors.values())


def make_adapter(folder: Path, name: str, base: str = "smollm2-135m-instruct") -> Path:
    """Write adapter ``name`` under ``folder`` (``folder/name``) and return its path."""
    rng = random.Random(f"lora:{name}")
    tensors: dict[str, tuple[tuple[int, int], bytes]] = {}
    for layer in range(LAYERS):
        for module, width in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = ((RANK, HIDDEN),
                                                  _tensor(rng, RANK, HIDDEN, 0.02))
            tensors[f"{prefix}.lora_B.weight"] = ((width, RANK), _tensor(rng, width, RANK, 0.02))
    out = folder / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(TARGETS), "fan_in_fan_out": False, "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


# ---------------------------------------------------------------------- a fleet of adapters
ADAPTERS = ("alpha", "beta")
LOAD_COST = 4096  # reference tokens: two window slots' worth of prompt (core/routing/base.py)

GATEWAY_CONFIG = """
fleet: {{router: least-load, window: {{mode: fixed}}}}
models:
  - {{name: {base}}}
{adapters}request_log: {{sample: 1, path: {log}}}
upstreams:
{upstreams}"""


def gateway_config(base: str, upstreams: dict[str, str], log: Path,
                   load_cost: float = LOAD_COST) -> str:
    """A gateway in front of ``upstreams`` (name -> URL), each serving ``base`` and the adapters
    ``ADAPTERS`` of it (their engines list them: the upstreams name no models), every request
    in its request log at ``log``."""
    adapters = "".join(f"  - {{name: {a}, base: {base}, load_cost: {load_cost}}}\n"
                       for a in ADAPTERS)
    ups = "".join(f"  - {{url: {url}, name: {name}, max_window: 4}}\n"
                  for name, url in upstreams.items())
    return GATEWAY_CONFIG.format(base=base, adapters=adapters, log=log, upstreams=ups)


@dataclass
class Served:
    """Where each request went (by the gateway's request log) and how long it took."""

    replicas: dict[str, list[str]] = field(default_factory=dict)  # model -> replica per request
    seconds: dict[str, list[float]] = field(default_factory=dict)  # model -> time per request


def chat_body(model: str, max_tokens: int = 4) -> bytes:
    return json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hi"}]}).encode()


def serve_in_turn(gateway_url: str, log: Path, models: Sequence[str], rounds: int) -> Served:
    """One request per model per round, each answered before the next is sent, through the
    gateway; where each ran is read from the request log (its line names the replica)."""
    out = Served()
    ids: list[tuple[str, str]] = []
    for _ in range(rounds):
        for model in models:
            t = time.monotonic()
            code, headers, body = http("POST", gateway_url + "/v1/chat/completions",
                                       chat_body(model), {"Content-Type": "application/json",
                                                          "Authorization": "Bearer none"},
                                       timeout=120)
            assert code == 200, body
            out.seconds.setdefault(model, []).append(time.monotonic() - t)
            ids.append((model, headers["x-qosgate-request-id"]))

    def lines() -> dict[str, str]:
        found: dict[str, str] = {}
        for raw in log.read_text().splitlines() if log.exists() else ():
            line = json.loads(raw)
            found[line["id"]] = line["replica"]
        return found

    assert wait_until(lambda: all(rid in lines() for _, rid in ids), 30), "request log"
    where = lines()
    for model, rid in ids:
        out.replicas.setdefault(model, []).append(where[rid])
    return out
