"""The Responses API's answers as the stand-in writes them (``wire/responses_api.py``): events
named and numbered in order, members by name as vLLM's, the text the deltas make, and the
status a cap gives. (Against a real vLLM 0.32: ``tests/e2e/vllm/test_contract.py``.)"""

from __future__ import annotations

import json

from qosgate.wire.responses_api import ResponsesFormatter


def test_a_stream_is_named_numbered_events_whose_deltas_make_the_text() -> None:
    fmt = ResponsesFormatter("r1", "m", b'{"temperature": 0, "max_output_tokens": 2}')
    raw = fmt.opening() + fmt.token("Hello") + fmt.token(" there") + fmt.closing("length", 7, 2)
    blocks = [b for b in raw.decode().split("\n\n") if b]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    events = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in blocks]
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(list(e) == sorted(e) for e in events)
    assert "".join(e["delta"] for e in events if "delta" in e) == "Hello there"
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and done["status"] == "incomplete"
    assert done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["content"][0]["text"] == "Hello there"
    assert (done["usage"]["input_tokens"], done["usage"]["output_tokens"]) == (7, 2)
    assert done["temperature"] == 0.0 and isinstance(done["temperature"], float)


def test_a_whole_answer_that_stopped_by_itself_is_completed() -> None:
    doc = json.loads(ResponsesFormatter("r2", "m").whole("Hi.", "stop", 5, 3))
    assert doc["object"] == "response" and doc["status"] == "completed"
    assert doc["incomplete_details"] is None and doc["usage"]["total_tokens"] == 8
