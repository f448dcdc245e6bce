"""LoRA adapters on the stand-in, as vLLM 0.32 serves them (the real one's answers are checked by
``tests/e2e/vllm/test_lora.py``): listed in ``/v1/models``, named by ``model``, the unknown one's
404, ``vllm:lora_requests_info``, cold loads past ``--max-loras`` and the runtime load API."""

from __future__ import annotations

from typing import Any

import pytest

from qosgate.standin.lora import LoraAdapters, parse_modules
from qosgate.wire.lora_info import loaded_adapters
from tests.support.standin import MODEL, post_all, post_together

MODULES = {"alpha": "/adapters/alpha", "beta": "/adapters/beta"}


def chat(model: str) -> tuple[str, dict[str, Any]]:
    return ("/v1/chat/completions", {"model": model, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "Say hi"}]})


def _lora(max_loras: int = 1) -> LoraAdapters:
    return LoraAdapters(MODULES, max_loras, load_s=0.02)


def test_adapters_are_listed_after_the_base_as_vllm_lists_them() -> None:
    (models,) = post_all([("/v1/models", {})], lora=_lora())
    cards = models.json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "alpha", "beta"]
    assert cards[1]["root"] == "/adapters/alpha"
    assert cards[1]["parent"] == MODEL
    assert cards[1]["max_model_len"] is None
    assert cards[0]["parent"] is None


def test_an_adapter_is_served_and_an_unknown_one_is_vllms_404() -> None:
    ok, missing = post_all([chat("alpha"), chat("nosuch")], lora=_lora())
    assert ok.status == 200
    assert missing.status == 404
    assert missing.json() == {"error": {
        "message": f"The model `nosuch` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError", "param": "model", "code": 404}}


def test_without_enable_lora_an_adapter_name_is_unknown() -> None:
    (answer,) = post_all([chat("alpha")])
    assert answer.status == 404


@pytest.mark.parametrize(("max_loras", "loads"), [(1, 3), (2, 2)])
def test_cold_loads_past_max_loras_least_recently_used_first(max_loras: int, loads: int) -> None:
    lora = _lora(max_loras)
    answers = post_all([chat("alpha"), chat("alpha"), chat("beta"), chat("alpha")], lora=lora)
    assert [a.status for a in answers] == [200] * 4
    assert lora.loads == loads


def test_the_lora_metric_names_the_adapter_last_served() -> None:
    lora = _lora()
    *_, metrics = post_all([chat("alpha"), chat("beta"), ("/metrics", {})], lora=lora)
    text = metrics.body.decode()
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="beta",' \
           'waiting_lora_adapters="beta"}' in text
    found = loaded_adapters(text)
    assert found is not None and found.loaded == ("beta",) and found.capacity == 1


def test_two_adapters_at_once_on_one_slot_take_turns() -> None:
    lora = _lora(1)
    answers = post_together([chat("alpha"), chat("beta"), chat("alpha")], lora=lora)
    assert [a.status for a in answers] == [200] * 3
    assert lora.loads >= 2
    assert lora.active == {}


def test_the_runtime_load_api() -> None:
    lora = LoraAdapters({}, 1, load_s=0.0)
    load = ("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": "/adapters/gamma"})
    answers = post_all([
        load, load, ("/v1/models", {}), chat("gamma"),
        ("/v1/unload_lora_adapter", {"lora_name": "gamma"}),
        ("/v1/unload_lora_adapter", {"lora_name": "gamma"}), chat("gamma"),
    ], lora=lora, runtime_lora_updating=True)
    added, again, models, served, removed, gone, unknown = answers
    assert (added.status, added.body) == (
        200, b"Success: LoRA adapter 'gamma' added successfully.")
    assert again.status == 400 and again.json()["error"]["type"] == "InvalidUserInput"
    assert [c["id"] for c in models.json()["data"]] == [MODEL, "gamma"]
    assert served.status == 200
    assert (removed.status, removed.body) == (
        200, b"Success: LoRA adapter 'gamma' removed successfully.")
    assert gone.status == 404 and gone.json()["error"]["message"] == (
        "The lora adapter 'gamma' cannot be found.")
    assert unknown.status == 404


def test_the_load_api_is_off_unless_runtime_updating_is_allowed() -> None:
    (answer,) = post_all([("/v1/load_lora_adapter", {"lora_name": "g", "lora_path": "/g"})],
                         lora=_lora())
    assert answer.status == 404 and answer.json() == {"detail": "Not Found"}


def test_lora_modules_are_name_equals_path() -> None:
    assert parse_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    with pytest.raises(ValueError, match="name=path"):
        parse_modules(["nopath"])
