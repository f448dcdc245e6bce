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
from array import array
from pathlib import Path

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
