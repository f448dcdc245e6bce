"""The batch store on its own: files, validation, fencing, answers written once, the end of a
job and its files, a store opened again after close. (Through a ``kill -9`` of its writer:
``tests/e2e/batches/test_store.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qosgate.runtime.batches.records import Fenced, LineResult
from qosgate.runtime.batches.store import BatchStore
from tests.support.batch_store import CHAT, MODEL, Clock, job, line, ok, read_jsonl, run, upload


def test_validate_reads_every_line_in_progress(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line(f"c{i}") for i in range(5)])
        assert (b.status, b.total, b.completed, b.failed, b.model) == (
            "in_progress", 5, 0, 0, MODEL)
        assert b.in_progress_at == int(Clock()())
        assert b.metadata == {"k": "v"}
        tasks = await s.next_lines(b.id, 10, ())
        assert [t.custom_id for t in tasks] == [f"c{i}" for i in range(5)]
        assert json.loads(tasks[0].body)["model"] == MODEL
        assert tasks[0].url == CHAT
        # validating twice reads nothing twice
        again = await s.validate(b.id, lambda m: True, 1)
        assert again.total == 5
        assert len(await s.next_lines(b.id, 10, ())) == 5
    run(go, tmp_path)


@pytest.mark.parametrize(("lines", "code", "lineno", "param"), [
    (["not json"], "invalid_json_line", 1, None),
    (["[1, 2]"], "invalid_json_line", 1, None),
    ([line("a"), line("a")], "duplicate_custom_id", 2, "custom_id"),
    ([line("a"), line("b", url="/v1/completions")], "url_mismatch", 2, "url"),
    ([line("a", method="GET")], "invalid_request", 1, "method"),
    ([line("a", model="nobody")], "model_not_found", 1, "body.model"),
    ([line("a"), line("b", model="other")], "model_mismatch", 2, "body.model"),
    ([json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": "x"})],
     "invalid_request", 1, "body"),
    ([json.dumps({"method": "POST", "url": CHAT, "body": {"model": MODEL}})],
     "invalid_request", 1, "custom_id"),
    ([], "empty_file", None, None),
])
def test_validate_fails_a_bad_file_as_openai(tmp_path: Path, lines: list[str], code: str,
                                              lineno: int | None, param: str | None) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, lines)
        assert b.status == "failed"
        assert b.failed_at is not None
        assert b.total == 0
        assert [(e.code, e.line, e.param) for e in b.errors] == [(code, lineno, param)]
        assert await s.next_lines(b.id, 10, ()) == []
    run(go, tmp_path)


def test_validate_counts_lines_against_the_limit(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line(f"c{i}") for i in range(4)])
        assert b.status == "failed"
        assert [e.code for e in b.errors] == ["too_many_tasks"]
        fits = await job(s, [line(f"c{i}") for i in range(3)] + [""])  # a blank line is none
        assert (fits.status, fits.total) == ("in_progress", 3)
    run(go, tmp_path, max_lines=3)


def test_record_writes_each_answer_once_and_counts(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line(f"c{i}") for i in range(4)])
        refused = LineResult(b.id, 1, "r1", 400, b'{"error":{}}')
        assert await s.record(1, [ok(b.id, 0), refused]) == 2
        # the same lines again (a retry that raced its first answer): nothing changes
        assert await s.record(1, [ok(b.id, 0, "second"), ok(b.id, 1)]) == 0
        now = await s.batch(b.id, None)
        assert now is not None
        assert (now.completed, now.failed) == (1, 1)
        assert [t.line for t in await s.next_lines(b.id, 10, ())] == [2, 3]
        assert [t.line for t in await s.next_lines(b.id, 10, [2])] == [3]
        assert [t.line for t in await s.next_lines(b.id, 1, ())] == [2]
    run(go, tmp_path)


def test_a_stale_fence_writes_nothing(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line("a"), line("b")])
        assert await s.claim(b.id, 5)  # another owner took the job over
        assert not await s.claim(b.id, 3)  # an older one cannot take it back
        assert await s.claim(b.id, 5)  # the owner's own claim again holds
        with pytest.raises(Fenced):
            await s.record(1, [ok(b.id, 0)])
        with pytest.raises(Fenced):
            await s.count_attempt(b.id, 0, 1)
        with pytest.raises(Fenced):
            await s.finish(b.id, 1, "completed")
        now = await s.batch(b.id, None)
        assert now is not None
        assert (now.completed, now.status, now.fence) == (0, "in_progress", 5)
        assert len(await s.next_lines(b.id, 10, ())) == 2
        await s.count_attempt(b.id, 1, 5)
        tasks = await s.next_lines(b.id, 10, ())
        assert [t.attempts for t in tasks] == [0, 1]
    run(go, tmp_path)


def test_lines_sharing_a_prefix_go_out_together(tmp_path: Path) -> None:
    long_a, long_b = "A" * 600, "B" * 600
    contents = [long_a + "1", "solo", long_b + "1", long_a + "2", long_b + "2", long_a + "3"]

    async def go(s: BatchStore) -> None:
        b = await job(s, [line(f"c{i}", c) for i, c in enumerate(contents)])
        order = [t.line for t in await s.next_lines(b.id, 10, ())]
        # groups in the order of their first line; within a group, file order
        assert order == [0, 3, 5, 1, 2, 4]
    run(go, tmp_path)


def test_finish_writes_output_and_error_files_in_openai_format(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line(f"c{i}") for i in range(4)])
        await s.record(1, [ok(b.id, 2), ok(b.id, 0),
                           LineResult(b.id, 1, "r1", 500, b"engine broke")])
        done = await s.finish(b.id, 1, "expired")
        assert done.status == "expired"
        assert done.expired_at is not None
        assert (done.total, done.completed, done.failed) == (4, 2, 2)
        assert done.output_file_id and done.error_file_id
        out = await s.file(done.output_file_id, "t")
        err = await s.file(done.error_file_id, "t")
        assert out is not None and err is not None
        assert (out.purpose, out.lines, out.filename) == (
            "batch_output", 2, f"{b.id}_output.jsonl")
        assert (err.purpose, err.lines, err.filename) == ("batch_output", 2, f"{b.id}_error.jsonl")
        outs = read_jsonl(s.file_path(out.id))
        assert out.bytes == s.file_path(out.id).stat().st_size
        assert [o["custom_id"] for o in outs] == ["c0", "c2"]
        assert outs[0]["response"]["status_code"] == 200
        assert outs[0]["response"]["request_id"] == "req-0"
        assert outs[0]["response"]["body"]["choices"][0]["message"]["content"] == "x"
        assert outs[0]["error"] is None
        assert outs[0]["id"].startswith("batch_req_")
        errs = read_jsonl(s.file_path(err.id))
        assert [e["custom_id"] for e in errs] == ["c1", "c3"]
        assert errs[0]["response"] == {"status_code": 500, "request_id": "r1",
                                       "body": "engine broke"}
        assert errs[1]["response"] is None
        assert errs[1]["error"]["code"] == "batch_expired"
        # ended: the same call again changes nothing, and nothing more is recorded
        assert (await s.finish(b.id, 1, "completed")).status == "expired"
        assert await s.record(1, [ok(b.id, 3)]) == 0
    run(go, tmp_path)


def test_finish_without_errors_writes_no_error_file(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line("a")])
        await s.record(1, [ok(b.id, 0)])
        done = await s.finish(b.id, 1, "completed")
        assert (done.status, done.error_file_id) == ("completed", None)
        assert done.finalizing_at is not None and done.completed_at is not None
        assert done.output_file_id is not None
    run(go, tmp_path)


def test_cancel_then_finish_keeps_the_finished_lines(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        b = await job(s, [line("a"), line("b")])
        await s.record(1, [ok(b.id, 0)])
        assert await s.request_cancel(b.id, "other") is None
        c = await s.request_cancel(b.id, "t")
        assert c is not None
        assert (c.status, c.cancelling_at) == ("cancelling", int(Clock()()))
        assert [x.id for x in await s.live()] == [b.id]
        done = await s.finish(b.id, 1, "cancelled")
        assert (done.status, done.completed, done.failed) == ("cancelled", 1, 1)
        assert done.error_file_id is not None
        errs = read_jsonl(s.file_path(done.error_file_id))
        assert errs[0]["error"]["code"] == "batch_cancelled"
        assert await s.live() == []
        again = await s.request_cancel(b.id, "t")
        assert again is not None and again.status == "cancelled"
    run(go, tmp_path)


def test_reopened_store_has_everything(tmp_path: Path) -> None:
    async def first(s: BatchStore) -> str:
        b = await job(s, [line("a"), line("b")])
        await s.record(1, [ok(b.id, 0)])
        return b.id

    batch_id = run(first, tmp_path)

    async def second(s: BatchStore) -> None:
        b = await s.batch(batch_id, "t")
        assert b is not None
        assert (b.status, b.completed, b.fence) == ("in_progress", 1, 1)
        assert [t.line for t in await s.next_lines(batch_id, 10, ())] == [1]
        assert [x.id for x in await s.live()] == [batch_id]
        st = await s.stats()
        assert st["jobs_in_progress"] == 1
        assert (st["lines_completed"], st["lines_pending"]) == (1, 1)
    run(second, tmp_path)


def test_files_are_the_tenants_own_and_paged(tmp_path: Path) -> None:
    clock = Clock()

    async def go(s: BatchStore) -> None:
        ids = []
        for i in range(5):
            clock.t += 1
            ids.append(await upload(s, line(f"c{i}") + "\n"))
        other = await upload(s, line("x") + "\n", tenant="u")
        assert await s.file(other, "t") is None
        assert await s.file(ids[0], "u") is None
        p1 = await s.files("t", None, None, 2)
        assert [f.id for f in p1.items] == [ids[4], ids[3]] and p1.has_more
        p2 = await s.files("t", "batch", ids[3], 2)
        assert [f.id for f in p2.items] == [ids[2], ids[1]] and p2.has_more
        p3 = await s.files("t", None, ids[1], 2)
        assert [f.id for f in p3.items] == [ids[0]] and not p3.has_more
        asc = await s.files("t", None, None, 10, order="asc")
        assert [f.id for f in asc.items] == ids
        assert (await s.files("t", "batch_output", None, 10)).items == ()
        assert not await s.delete_file(ids[0], "u")
        assert await s.delete_file(ids[0], "t")
        assert not s.file_path(ids[0]).exists()
        assert await s.file(ids[0], "t") is None
        assert not await s.delete_file(ids[0], "t")
    run(go, tmp_path, clock)


def test_jobs_are_listed_newest_first_per_tenant(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        fid = await upload(s, line("a") + "\n")
        ids = [(await s.create_batch("t", fid, CHAT, "24h", 3600, "batch", None)).id
               for _ in range(3)]
        await s.create_batch("u", fid, CHAT, "24h", 3600, "batch", None)
        page = await s.batches("t", None, 2)
        assert [b.id for b in page.items] == [ids[2], ids[1]] and page.has_more
        rest = await s.batches("t", ids[1], 2)
        assert [b.id for b in rest.items] == [ids[0]] and not rest.has_more
        assert len((await s.batches(None, None, 10)).items) == 4
        assert await s.batch(ids[0], "u") is None
        b = await s.batch(ids[0], None)
        assert b is not None and b.expires_at == b.created_at + 3600
    run(go, tmp_path)


def test_a_deleted_input_file_fails_the_job(tmp_path: Path) -> None:
    async def go(s: BatchStore) -> None:
        fid = await upload(s, line("a") + "\n")
        b = await s.create_batch("t", fid, CHAT, "24h", 3600, "batch", None)
        assert await s.delete_file(fid, "t")
        v = await s.validate(b.id, lambda m: True, 0)
        assert v.status == "failed"
        assert [e.param for e in v.errors] == ["input_file_id"]
    run(go, tmp_path)


def test_two_stores_on_one_database_fence_each_other(tmp_path: Path) -> None:
    """Two gateway processes sharing the directory: the one whose claim is newer writes."""
    async def go(a: BatchStore) -> None:
        b = await job(a, [line("a"), line("b")])
        other = BatchStore(tmp_path, Clock())
        await other.open()
        try:
            assert await other.claim(b.id, 2)
            with pytest.raises(Fenced):
                await a.record(1, [ok(b.id, 0)])
            assert await other.record(2, [ok(b.id, 0)]) == 1
            seen = await a.batch(b.id, None)
            assert seen is not None and (seen.completed, seen.fence) == (1, 2)
        finally:
            await other.close()
    run(go, tmp_path)




