"""The list of what the embedded engine does with each request member (``textparams.py``) is the
one the parser applies and the one docs/guides/engine.md shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qosgate.wire.textparams import BY_NAME, PARAMS, REFUSED, Param
from qosgate.wire.textreq import BadTextRequest, parse_text_request

DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "engine.md"
ROW = re.compile(r"^\| ((?:`[^`]+`(?:, )?)+) \| (honoured|refused|ignored) \|", re.M)


def test_the_docs_table_lists_every_member_with_its_status() -> None:
    documented: dict[str, str] = {}
    for names, status in ROW.findall(DOC.read_text()):
        for name in re.findall(r"`([^`]+)`", names):
            assert name not in documented, f"{name} is twice in the table"
            documented[name] = status
    assert documented == {p.name: p.status for p in PARAMS}


@pytest.mark.parametrize("param", REFUSED, ids=lambda p: p.name)
def test_every_refused_member_is_refused_and_named(param: Param) -> None:
    name = param.name
    body = {"messages": [{"role": "user", "content": "hi"}], name: {"asks": "something"}}
    with pytest.raises(BadTextRequest) as err:
        parse_text_request(json.dumps(body).encode(), "chat")
    assert err.value.param == name


def test_values_that_ask_for_nothing_pass() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [], "logprobs": False,
            "best_of": 1, "tool_choice": "none", "modalities": ["text"], "suffix": "",
            "verbosity": "medium", "min_tokens": 0, "top_logprobs": 0, "stream_options": None}
    parse_text_request(json.dumps(body).encode(), "chat")
    with pytest.raises(BadTextRequest) as err:  # completions: 0 still asks for the chosen tokens'
        parse_text_request(b'{"prompt": "hi", "logprobs": 0}', "completions")
    assert err.value.param == "logprobs"
    assert BY_NAME["logprobs"].status == "refused"
