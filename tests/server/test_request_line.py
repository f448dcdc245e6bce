"""The request log's line (``server/request_line.py``) and its writer (``server/request_log.py``):
the fields of a request the scheduler had and of one refused before it, which requests get a
line (errors by default, the rest sampled by a hash of the id), and one write per line."""

from __future__ import annotations

import json
from pathlib import Path

from qosgate.core import Request, State
from qosgate.server.request_line import (
    core_line,
    encoded,
    gateway_line,
    is_error,
    sampled,
    timestamp,
    wanted,
)
from qosgate.server.request_log import RequestLog
from qosgate.settings import RequestLogSettings

WALL = 1_700_000_000.25  # 2023-11-14T22:13:20.250Z


def served_request() -> Request:
    req = Request("ab12-7", "acme", "api", 1, 10.0, 15.0, 12, 64, model="m")
    req.replica = "r0"
    req.dispatched_at = 10.5
    req.first_token_at = 10.75
    req.finished_at = 12.0
    req.output_tokens = 9
    req.failures = 1
    req.preemptions = 2
    for to in (State.QUEUED, State.DISPATCHED, State.RUNNING):
        req.move(to)
    req.move(State.COMPLETED, "completed")
    return req


def test_a_served_request_s_line_names_where_it_ran_and_its_times_from_arrival() -> None:
    line = json.loads(encoded(core_line(served_request(), "chat", 200, WALL, "client-7")))
    assert line == {
        "ts": "2023-11-14T22:13:20.250Z", "id": "ab12-7", "tenant": "acme", "class": "api",
        "model": "m", "replica": "r0", "route": "chat", "outcome": "completed",
        "reason": "completed",
        "status": 200, "queue_wait_s": 0.5, "ttft_s": 0.75, "duration_s": 2.0,
        "prompt_tokens": 12, "completion_tokens": 9, "failed_attempts": 1, "preemptions": 2,
        "client_request_id": "client-7",
    }
    assert list(line) == ["ts", "id", "tenant", "class", "model", "replica", "route", "outcome",
                          "reason", "status", "queue_wait_s", "ttft_s", "duration_s",
                          "prompt_tokens", "completion_tokens", "failed_attempts",
                          "preemptions", "client_request_id"]


def test_a_request_refused_in_the_queue_has_no_times_past_its_end() -> None:
    req = Request("ab12-8", "acme", "batch", 2, 10.0, 15.0, 12, 64)
    req.move(State.REJECTED, "queue_full")
    req.finished_at = 10.0
    line = json.loads(encoded(core_line(req, "completions", 429, WALL)))
    assert (line["outcome"], line["reason"], line["status"]) == ("rejected", "queue_full", 429)
    assert line["queue_wait_s"] is None and line["ttft_s"] is None
    assert line["duration_s"] == 0.0 and line["completion_tokens"] is None
    assert line["model"] is None and line["replica"] is None
    assert line["client_request_id"] is None


def test_a_line_of_a_request_refused_before_the_scheduler() -> None:
    line = json.loads(encoded(gateway_line("ab12-9", "unknown", "none", "chat", "rejected",
                                           "invalid_api_key", 401, 0.0012, WALL)))
    assert line["id"] == "ab12-9" and line["tenant"] == "unknown" and line["class"] == "none"
    assert (line["outcome"], line["reason"], line["status"]) == (
        "rejected", "invalid_api_key", 401)
    assert line["duration_s"] == 0.0012 and line["failed_attempts"] == 0


def test_sampling_is_a_hash_of_the_id_the_same_every_time() -> None:
    ids = [f"5eed0001-{n}" for n in range(20_000)]
    half = [rid for rid in ids if sampled(rid, 0.5)]
    assert half == [rid for rid in ids if sampled(rid, 0.5)]  # no random draw
    assert 0.47 < len(half) / len(ids) < 0.53
    tenth = {rid for rid in ids if sampled(rid, 0.1)}
    assert 0.08 < len(tenth) / len(ids) < 0.12
    assert tenth <= set(half)  # a larger share keeps every id a smaller one chose
    assert all(sampled(rid, 1.0) for rid in ids[:100])
    assert not any(sampled(rid, 0.0) for rid in ids[:100])


def test_errors_are_wanted_by_their_own_switch_the_rest_by_the_sample() -> None:
    assert is_error("rejected", "queue_full") and is_error("timed_out", "queue_timeout")
    assert is_error("failed", "engine_error") and is_error("cancelled", "shutting_down")
    assert not is_error("cancelled", "client_disconnected") and not is_error("completed", None)
    assert wanted("x-1", "failed", "engine_error", errors=True, share=0.0)
    assert not wanted("x-1", "failed", "engine_error", errors=False, share=1.0)
    assert not wanted("x-1", "completed", None, errors=True, share=0.0)
    assert wanted("x-1", "completed", None, errors=False, share=1.0)
    assert wanted("x-1", "cancelled", "client_disconnected", errors=False, share=1.0)


def test_the_log_writes_one_line_per_wanted_request_and_nothing_when_off() -> None:
    lines: list[bytes] = []
    log = RequestLog(RequestLogSettings(), lines.append, wall=lambda: WALL)
    log.ended(served_request(), "chat", 200)  # served, sample 0: no line
    log.refused("ab12-10", "acme", "none", "chat", "model_not_found", 404, 0.001)
    assert len(lines) == 1 and lines[0].endswith(b"\n") and lines[0].count(b"\n") == 1
    assert json.loads(lines[0])["reason"] == "model_not_found"
    off = RequestLog(RequestLogSettings(enabled=False), lines.append)
    off.refused("ab12-11", "acme", "none", "chat", "model_not_found", 404, 0.001)
    assert len(lines) == 1
    everything = RequestLog(RequestLogSettings(sample=1.0), lines.append)
    everything.ended(served_request(), "chat", 200)
    assert len(lines) == 2 and json.loads(lines[1])["outcome"] == "completed"


def test_a_file_destination_is_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"earlier": true}\n')
    log = RequestLog(RequestLogSettings(path=str(path)), wall=lambda: WALL)
    log.refused("ab12-12", "acme", "none", "chat", "model_not_found", 404, 0.001)
    log.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0] == {"earlier": True} and rows[1]["id"] == "ab12-12"


def test_timestamps_are_utc_to_the_millisecond() -> None:
    assert timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert timestamp(WALL) == "2023-11-14T22:13:20.250Z"
