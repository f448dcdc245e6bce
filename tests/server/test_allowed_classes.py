"""A tenant's ``allowed_classes`` over HTTP, in process: a class it may not use is a 403 naming
the ones it may (counted as one refusal), what it may use is boosted by its tier, and a Batch API
job's lines run at the job's class without the boost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.batches import submit, wait_status
from tests.support.inprocess import InProcessGateway
from tests.support.metrics import metric_values

CONFIG = """
tenants:
  - {name: free-tier, api_keys: [sk-free], tier: free, allowed_classes: [api, batch, offline]}
  - {name: big, api_keys: [sk-big], tier: enterprise}
"""
MODEL = "qosgate-sim"
HI = [{"role": "user", "content": "hi"}]
REFUSAL = {"error": {
    "message": "This API key's tenant may not use class 'realtime'; its classes are api, batch, "
               "offline.",
    "type": "permission_error", "param": "x-qos-class", "code": "class_not_allowed"}}


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with InProcessGateway(CONFIG) as gw:
        yield gw


def _refused(gw: InProcessGateway) -> float:
    text = gw.http("GET", gw.url + "/metrics")[2].decode()
    return sum(v for k, v in metric_values(text, "qosgate_requests_total").items()
               if ("reason", "class_not_allowed") in k and ("outcome", "rejected") in k)


def _served_class(gw: InProcessGateway, headers: dict[str, str]) -> str:
    code, hdrs, out = gw.http("POST", gw.url + "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": HI, "max_tokens": 2}).encode(),
        headers={"Authorization": "Bearer sk-free", **headers})
    assert code == 200, out
    return str(hdrs["x-qosgate-class"])


def test_a_class_outside_the_allowed_ones_is_a_403_counted_once(
    gateway: InProcessGateway,
) -> None:
    before = _refused(gateway)
    code, _, out = gateway.http("POST", gateway.url + "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": HI, "max_tokens": 2}).encode(),
        headers={"Authorization": "Bearer sk-free", "x-qos-class": "realtime"})
    assert (code, json.loads(out)) == (403, REFUSAL)
    assert _refused(gateway) == before + 1
    with pytest.raises(openai.PermissionDeniedError) as exc:
        gateway.client("sk-free").chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2,  # type: ignore[arg-type]
            extra_body={"qos_class": "realtime"})
    assert (exc.value.code, exc.value.param) == ("class_not_allowed", "qos_class")
    assert _refused(gateway) == before + 2


def test_asking_for_more_gets_no_more(gateway: InProcessGateway) -> None:
    # the free tier's +1 applies to what it may ask for; a priority above it is clamped first
    assert _served_class(gateway, {"x-qos-class": "api"}) == "batch"
    assert _served_class(gateway, {}) == "batch"
    assert _served_class(gateway, {"x-qos-priority": "0"}) == "batch"


def test_a_job_refuses_a_class_it_may_not_use(gateway: InProcessGateway, tmp_path: Path) -> None:
    c = gateway.client("sk-free")
    with pytest.raises(openai.PermissionDeniedError) as exc:
        c.batches.create(input_file_id=c.files.create(
            file=("in.jsonl", b"{}\n"), purpose="batch").id, endpoint="/v1/chat/completions",
            completion_window="24h", metadata={"qos_class": "realtime"})
    assert (exc.value.code, exc.value.param) == ("class_not_allowed", "metadata.qos_class")


def test_a_jobs_lines_run_at_its_class_without_the_tier_boost(
    gateway: InProcessGateway, tmp_path: Path,
) -> None:
    c = gateway.client("sk-big")
    job = wait_status(c, submit(c, tmp_path, 2, model=MODEL), {"completed"})
    assert job.request_counts is not None and job.request_counts.completed == 2
    text = gateway.http("GET", gateway.url + "/metrics")[2].decode()
    served = {dict(k)["class"]: v for k, v in metric_values(text, "qosgate_requests_total").items()
              if ("tenant", "big") in k and ("outcome", "completed") in k}
    # the tier's interactive requests asking for batch get api; its job's lines stay at batch
    assert served == {"batch": 2}
