"""The Batch API's HTTP routes with the official ``openai`` client against a real gateway
process (the simulated engine). No feeder runs a job here: what the API alone does is tested,
and where a job must move on (validated, answered, ended) the test does the feeder's part on the
gateway's own database (the store is safe to share between processes)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import openai
import pytest
from openai import OpenAI

from qosgate.runtime.batches.records import LineResult
from qosgate.runtime.batches.store import BatchStore
from tests.support.httpclient import http
from tests.support.processes import Server, start_gateway

pytestmark = pytest.mark.e2e

MODEL = "qosgate-sim"
CHAT: Final = "/v1/chat/completions"
CONFIG = """
tenants:
  - {name: acme, api_keys: [sk-acme]}
  - {name: other, api_keys: [sk-other]}
  - {name: clamped, api_keys: [sk-clamped], allowed_classes: [batch, offline]}
engine: {kind: sim, time_scale: 0.02}
batches: {max_file_bytes: 4096, max_lines: 20, windows: ["24h", "2h"], feed: false}
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("batch-api")
    cfg = tmp / "batches.yaml"
    cfg.write_text(CONFIG)
    gw = start_gateway(tmp, "--config", str(cfg))
    yield gw
    gw.stop()


def state_dir(gw: Server) -> Path:
    """The gateway's batch directory: $XDG_STATE_HOME/qosgate/batches/<host>-<port>, the
    default for its address (tests/support/processes.py sets XDG_STATE_HOME)."""
    return gw.log.parent / f"state-{gw.port}" / "qosgate" / "batches" / f"127.0.0.1-{gw.port}"


def client(gw: Server, key: str = "sk-acme") -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def line(cid: str, model: str = MODEL, url: str = CHAT, method: str = "POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}})


def upload(c: OpenAI, tmp_path: Path, lines: list[str], name: str = "in.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(x + "\n" for x in lines))
    with path.open("rb") as f:
        return c.files.create(file=f, purpose="batch").id


def test_files_create_list_retrieve_content_delete(gateway: Server, tmp_path: Path) -> None:
    c = client(gateway)
    text = "".join(line(f"c{i}") + "\n" for i in range(3))
    (tmp_path / "a.jsonl").write_text(text)
    with (tmp_path / "a.jsonl").open("rb") as f:
        created = c.files.create(file=f, purpose="batch")
    assert created.id.startswith("file-") and len(created.id) == len("file-") + 24
    assert (created.object, created.purpose, created.filename, created.bytes, created.status) == (
        "file", "batch", "a.jsonl", len(text), "processed")
    got = c.files.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    assert c.files.content(created.id).content == text.encode()
    second = upload(c, tmp_path, [line("x")], "b.jsonl")
    listed = [f.id for f in c.files.list(purpose="batch")]
    assert listed.index(second) < listed.index(created.id)  # newest first
    page = c.files.list(limit=1, order="asc", after=created.id)
    assert [f.id for f in page.data][:1] == [listed[listed.index(created.id) - 1]]
    deleted = c.files.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        c.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        c.files.delete(created.id)


def test_batches_create_retrieve_list_cancel(gateway: Server, tmp_path: Path) -> None:
    c = client(gateway)
    fid = upload(c, tmp_path, [line("a"), line("b")])
    made = [c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h",
                             metadata={"job": str(i)}) for i in range(3)]
    b = made[0]
    assert b.id.startswith("batch_") and b.status == "validating"
    assert (b.input_file_id, b.endpoint, b.completion_window) == (fid, CHAT, "24h")
    assert b.expires_at == b.created_at + 86_400
    assert b.request_counts is not None and b.request_counts.total == 0
    assert b.metadata == {"job": "0"} and b.errors is None
    assert c.batches.retrieve(b.id).model_dump() == b.model_dump()
    page = c.batches.list(limit=2)
    assert [x.id for x in page.data] == [made[2].id, made[1].id] and page.has_more
    rest = c.batches.list(limit=2, after=made[1].id)
    assert [x.id for x in rest.data][:1] == [made[0].id]
    short = c.batches.create(input_file_id=fid, endpoint=CHAT,
                             completion_window="2h")  # type: ignore[arg-type]
    assert short.expires_at == short.created_at + 7200
    cancelled = c.batches.cancel(b.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert c.batches.retrieve(b.id).status == "cancelling"


def test_create_refuses_bad_parameters(gateway: Server, tmp_path: Path) -> None:
    c = client(gateway)
    fid = upload(c, tmp_path, [line("a")])
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=fid, endpoint="/v1/responses",
                         completion_window="24h")
    assert e.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=fid, endpoint=CHAT,
                         completion_window="1h")  # type: ignore[arg-type]
    assert e.value.param == "completion_window"
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-" + "0" * 24, endpoint=CHAT,
                         completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h",
                         extra_headers={"x-qos-class": "gold"})
    assert (e.value.code, e.value.param) == ("unknown_class", "x-qos-class")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_" + "0" * 24)


def test_a_job_asks_for_its_class(gateway: Server, tmp_path: Path) -> None:
    c = client(gateway)
    fid = upload(c, tmp_path, [line("a")])
    default = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    offline = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h",
                               metadata={"qos_class": "offline"})
    header = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h",
                              extra_headers={"x-qos-class": "Offline"})
    fid = upload(client(gateway, "sk-clamped"), tmp_path, [line("a")])
    # the tenant allowed only batch and offline asks for realtime: refused, as its requests are
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(gateway, "sk-clamped").batches.create(
            input_file_id=fid, endpoint=CHAT, completion_window="24h",
            extra_headers={"x-qos-class": "realtime"})
    assert (e.value.code, e.value.param) == ("class_not_allowed", "x-qos-class")
    ids = [default.id, offline.id, header.id]
    assert asyncio.run(_classes(state_dir(gateway), ids)) == ["batch", "offline", "offline"]


async def _classes(directory: Path, ids: list[str]) -> list[str]:
    store = BatchStore(directory, lambda: 0.0)
    await store.open()
    try:
        return [b.qos_class for b in [await store.batch(i, None) for i in ids] if b]
    finally:
        await store.close()


@pytest.mark.parametrize(("name", "purpose", "body", "code", "param"), [
    ("in.txt", "batch", "x\n", None, "file"),  # OpenAI: a batch file must be .jsonl
    ("in.jsonl", "fine-tune", "x\n", None, "purpose"),
    ("in.jsonl", "batch", "x" * 5000, "file_too_large", "file"),
    ("in.jsonl", "batch", "{}\n" * 21, "too_many_tasks", "file"),
    ("in.jsonl", "batch", "{}\n" * 20 + "{}", "too_many_tasks", "file"),
])
def test_upload_refuses_files_over_the_limits(gateway: Server, tmp_path: Path, name: str,
                                              purpose: str, body: str, code: str | None,
                                              param: str) -> None:
    c = client(gateway)
    before = {f.id for f in c.files.list()}
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=(name, body.encode()), purpose=purpose)  # type: ignore[arg-type]
    assert (e.value.code, e.value.param) == (code, param)
    assert {f.id for f in c.files.list()} == before
    assert list((state_dir(gateway) / "tmp").iterdir()) == []  # nothing staged is left


def test_upload_at_the_limits_is_taken(gateway: Server) -> None:
    c = client(gateway)
    f = c.files.create(file=("in.jsonl", b"{}\n" * 20), purpose="batch")
    assert f.bytes == 60


def test_a_bad_key_is_refused(gateway: Server) -> None:
    bad = client(gateway, "sk-nobody")
    with pytest.raises(openai.AuthenticationError):
        bad.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.AuthenticationError):
        bad.files.list()
    with pytest.raises(openai.AuthenticationError):
        bad.batches.list()
    code, _, _ = http("GET", gateway.url + "/v1/batches")
    assert code == 401


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PUT", "/v1/files", "GET, POST"),
    ("DELETE", "/v1/batches", "GET, POST"),
    ("POST", "/v1/files/file-x", "GET, DELETE"),
    ("DELETE", "/v1/files/file-x/content", "GET"),
    ("DELETE", "/v1/batches/batch_x", "GET"),
    ("GET", "/v1/batches/batch_x/cancel", "POST"),
])
def test_another_method_on_a_batch_route_is_a_405(gateway: Server, method: str, path: str,
                                                  allow: str) -> None:
    code, headers, body = http(method, gateway.url + path,
                               headers={"Authorization": "Bearer sk-acme"})
    assert code == 405 and headers["allow"] == allow
    assert json.loads(body)["error"]["code"] == "method_not_allowed"


def test_tenants_see_only_their_own(gateway: Server, tmp_path: Path) -> None:
    acme, other = client(gateway), client(gateway, "sk-other")
    fid = upload(acme, tmp_path, [line("a")])
    job = acme.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(fid)
    with pytest.raises(openai.NotFoundError):
        other.files.content(fid)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(fid)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(job.id)
    with pytest.raises(openai.NotFoundError):  # another's file is no input file either
        other.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    assert fid not in {f.id for f in other.files.list()}
    assert job.id not in {b.id for b in other.batches.list()}
    assert acme.batches.retrieve(job.id).status == "validating"
    assert acme.files.retrieve(fid).id == fid


@pytest.mark.parametrize(("lines", "code", "lineno"), [
    (["this is not json"], "invalid_json_line", 1),
    ([line("a"), line("b", method="GET")], "invalid_request", 2),
    ([line("a", url="/v1/completions")], "url_mismatch", 1),
    ([line("a"), line("b"), line("a")], "duplicate_custom_id", 3),
    ([line("a", model="nobody-serves-this")], "model_not_found", 1),
])
def test_a_bad_file_fails_its_job_with_openai_errors(gateway: Server, tmp_path: Path,
                                                     lines: list[str], code: str,
                                                     lineno: int) -> None:
    c = client(gateway)
    fid = upload(c, tmp_path, lines)
    job = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    asyncio.run(_feeder_validates(state_dir(gateway), job.id))
    failed = c.batches.retrieve(job.id)
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and failed.errors.data is not None
    assert [(e.code, e.line) for e in failed.errors.data] == [(code, lineno)]


async def _feeder_validates(directory: Path, batch_id: str) -> None:
    store = BatchStore(directory, lambda: 1_700_000_000.0)
    await store.open()
    try:
        await store.validate(batch_id, lambda m: m == MODEL, 0)
    finally:
        await store.close()


def test_finished_job_files_are_read_with_the_client(gateway: Server, tmp_path: Path) -> None:
    c = client(gateway)
    fid = upload(c, tmp_path, [line("a"), line("b"), line("c")])
    job = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    asyncio.run(_feeder_answers_one_and_cancels(state_dir(gateway), job.id))
    ended = c.batches.retrieve(job.id)
    assert ended.status == "cancelled"
    assert ended.request_counts is not None
    assert (ended.request_counts.total, ended.request_counts.completed,
            ended.request_counts.failed) == (3, 1, 2)
    assert ended.output_file_id and ended.error_file_id
    out = [json.loads(x) for x in c.files.content(ended.output_file_id).text.splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"]) for o in out] == [("b", 200)]
    errs = [json.loads(x) for x in c.files.content(ended.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [
        ("a", "batch_cancelled"), ("c", "batch_cancelled")]
    meta = c.files.retrieve(ended.output_file_id)
    assert (meta.purpose, meta.filename) == ("batch_output", f"{job.id}_output.jsonl")
    assert ended.output_file_id in {f.id for f in c.files.list(purpose="batch_output")}
    with pytest.raises(openai.NotFoundError):
        client(gateway, "sk-other").files.content(ended.output_file_id)


async def _feeder_answers_one_and_cancels(directory: Path, batch_id: str) -> None:
    store = BatchStore(directory, lambda: 1_700_000_000.0)
    await store.open()
    try:
        assert await store.claim(batch_id, 1)
        await store.validate(batch_id, lambda m: m == MODEL, 1)
        await store.record(1, [LineResult(batch_id, 1, "req-1", 200, b'{"choices": []}')])
        await store.finish(batch_id, 1, "cancelled")
    finally:
        await store.close()


def _open_and_close(directory: str) -> None:
    async def go() -> None:
        store = BatchStore(Path(directory), lambda: 0.0)
        await store.open()
        await store.close()

    asyncio.run(go())


def test_workers_opening_one_new_store_together_all_start(tmp_path: Path) -> None:
    """``serve --workers`` opens one new database from several processes at once: each must
    open it (a worker failed to start on "database is locked" from the switch to WAL)."""
    ctx = multiprocessing.get_context("spawn")
    for round_ in range(4):
        directory = tmp_path / f"round-{round_}"
        procs = [ctx.Process(target=_open_and_close, args=(str(directory),)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
