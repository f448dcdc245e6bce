"""What a reload changes (``server/reload.py``), and ``POST /v1/qos/reload`` on the gateway in
this process. (SIGHUP under load, a bad file and ``--workers``: ``tests/e2e/test_reload.py``.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from qosgate.config import ConfigError, config_from_mapping
from qosgate.server.reload import ReloadRefused, changes
from qosgate.settings import settings_from_mapping
from tests.support.inprocess import InProcessGateway

BASE = {"tenants": [{"name": "acme", "api_keys": ["k1"], "limits": {"requests_per_minute": 60}},
                    {"name": "old", "api_keys": ["k-old"]}]}


def both(doc: dict[str, Any], io: dict[str, Any] | None = None) -> Any:
    return config_from_mapping(doc), settings_from_mapping(io or {})


def test_changes_name_tenants_keys_and_what_waits_for_a_restart() -> None:
    new = {"tenants": [{"name": "acme", "api_keys": ["k1", "k2"],
                        "limits": {"requests_per_minute": 6}},
                       {"name": "newco", "api_keys": ["k-new"]}],
           "admission": {"max_prompt_tokens": 1000}}
    found = changes(both(BASE), both(new, {"server": {"port": 9999, "admin_keys": ["a"]}}))
    assert (found.tenants_added, found.tenants_removed, found.tenants_changed) == (
        ("newco",), ("old",), ("acme",))
    assert (found.keys_added, found.keys_removed) == (2, 1)
    assert found.admin_keys_changed
    assert found.needs_restart == ("admission", "server")  # the port: a restart applies it
    assert "kept until a restart: admission, server" in found.describe()


def test_classes_that_differ_refuse_the_whole_reload() -> None:
    cfg, settings = both(BASE)
    other = cfg.model_copy(update={"classes": tuple(
        c.model_copy(update={"ttft_budget_ms": c.ttft_budget_ms * 2}) for c in cfg.classes)})
    with pytest.raises(ReloadRefused, match="classes"):
        changes((cfg, settings), (other, settings))


CONFIG = """
server: {admin_keys: [sk-admin]}
tenants: [{name: acme, api_keys: [sk-acme]}]
"""


def test_the_admin_endpoint_reloads_or_says_why_not() -> None:
    with InProcessGateway(CONFIG) as gw:
        app = gw.gateway
        doc = yaml.safe_load(CONFIG)
        doc["tenants"].append({"name": "newco", "api_keys": ["sk-new"]})
        nxt: list[Any] = [both({"tenants": doc["tenants"]}, {"server": doc["server"]})]

        def source() -> Any:
            if isinstance(nxt[0], Exception):
                raise nxt[0]
            return nxt[0]

        app.config_source = source
        admin = {"authorization": "Bearer sk-admin"}
        code, _, _ = gw.http("POST", gw.url + "/v1/qos/reload", b"",
                             {"authorization": "Bearer sk-acme"})
        assert code == 401
        code, _, body = gw.http("POST", gw.url + "/v1/qos/reload", b"", admin)
        out = json.loads(body)
        assert code == 200 and out["generation"] == 2 and out["tenants"]["added"] == ["newco"]
        assert gw.client("sk-new").models.list().data
        nxt[0] = ConfigError("tenants.0.limits.rpm: Extra inputs are not permitted")
        code, _, body = gw.http("POST", gw.url + "/v1/qos/reload", b"", admin)
        err = json.loads(body)["error"]
        assert code == 400 and err["code"] == "config_refused" and "rpm" in err["message"]
        code, _, body = gw.http("GET", gw.url + "/v1/qos/status", None, admin)
        assert json.loads(body)["config"] == {"generation": 2,
                                              "reloads": {"applied": 1, "refused": 1}}
        assert gw.client("sk-new").models.list().data  # the running config kept


def test_upstreams_added_retired_and_changed_under_their_name() -> None:
    def ups(*pairs: tuple[str, str]) -> dict[str, Any]:
        return {"upstreams": [{"name": n, "url": u} for n, u in pairs]}

    old = both(BASE, ups(("a", "http://a:1"), ("b", "http://b:1")))
    new = both(BASE, ups(("a", "http://a:2"), ("c", "http://c:1")))
    found = changes(old, new)
    assert (found.upstreams_added, found.upstreams_retired) == (("c",), ("b",))
    assert found.needs_restart == ("upstreams (a)",)  # changed under its name: as it runs
    # from the built-in engine to upstreams: a restart
    assert changes(both(BASE), new).needs_restart == ("upstreams",)
