"""``deploy/``'s files read as ``qosgate serve`` would take them: the Containerfile, the Kubernetes
manifests and the systemd unit, each as the flags and variables it runs ``serve`` with
(``Deployed``), and ``serve``'s own parser to read them with. Shared by the static checks
(``tests/test_deploy.py``) and the gateways started from them (``tests/e2e/test_deploy.py``)."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from qosgate.cli import app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIG = DEPLOY / "qosgate.yaml"


# ---------------------------------------------------------------- qosgate serve, introspected
def serve_command() -> Any:
    return typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]


# read by serve beyond its options: where batch jobs live by default (runtime/batches/directory)
STATE_ENV = "XDG_STATE_HOME"


def serve_envvars() -> set[str]:
    return {p.envvar for p in serve_command().params if isinstance(p.envvar, str)} | {STATE_ENV}


def options(argv: list[str]) -> list[tuple[str, str | None]]:
    """``argv`` as (flag, value) pairs, by what serve declares: a value for options, none for
    on/off flags. An unknown flag fails here."""
    takes_value = {}
    for p in serve_command().params:
        for name in (*p.opts, *p.secondary_opts):
            takes_value[name] = not getattr(p, "is_flag", False)
    out: list[tuple[str, str | None]] = []
    it = iter(argv)
    for tok in it:
        flag, eq, val = tok.partition("=")
        assert flag in takes_value, f"{flag}: not an option of `qosgate serve`"
        if takes_value[flag]:
            out.append((flag, val if eq else next(it)))
        else:
            assert not eq, tok
            out.append((flag, None))
    return out


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
          ) -> dict[str, Any]:
    """What ``qosgate serve`` makes of these flags and variables: its own parser (types,
    choices, precedence), without running it."""
    unknown = set(env) - serve_envvars()
    assert not unknown, f"not read by `qosgate serve`: {unknown}"
    with monkeypatch.context() as m:
        for k in [k for k in os.environ if k.startswith("QOSGATE_")]:
            m.delenv(k)
        for k, v in env.items():
            m.setenv(k, v)
        ctx = serve_command().make_context("serve", list(argv))
    params: dict[str, Any] = ctx.params
    return params


@dataclass
class Deployed:
    """One file's way of running ``qosgate serve``."""

    argv: list[str]
    env: dict[str, str]  # literal values
    env_from: set[str]  # set at run time (Kubernetes fieldRef / secretKeyRef)


# ---------------------------------------------------------------- the files, read
def containerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, one entry per occurrence (continuations joined)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    out: dict[str, list[str]] = {}
    for ln in text.splitlines():
        ln = ln.strip()
        if ln and not ln.startswith("#"):
            word, _, rest = ln.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def container_deployed() -> Deployed:
    cf = containerfile()
    env = dict(kv.split("=", 1) for line in cf["ENV"] for kv in shlex.split(line))
    entry, cmd = json.loads(cf["ENTRYPOINT"][-1]), json.loads(cf["CMD"][-1])
    assert entry == ["qosgate", "serve"]
    return Deployed(cmd, {k: v for k, v in env.items() if k.startswith("QOSGATE_")}, set())


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]


def kind(docs: list[dict[str, Any]], k: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == k and d["metadata"]["name"] == name)


def k8s_container() -> dict[str, Any]:
    dep = kind(manifests("deployment.yaml"), "Deployment", "qosgate")
    c: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return c


def k8s_deployed() -> Deployed:
    c = k8s_container()
    env = {e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e}
    return Deployed(list(c.get("args", [])), env,
                    {e["name"] for e in c.get("env", []) if "valueFrom" in e})


def unit() -> dict[str, list[tuple[str, str]]]:
    """Section -> (key, value) in order (systemd repeats keys such as Environment=)."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for ln in (DEPLOY / "systemd" / "qosgate.service").read_text().splitlines():
        ln = ln.strip()
        if not ln or ln.startswith(("#", ";")):
            continue
        if ln.startswith("["):
            section = ln.strip("[]")
            continue
        k, _, v = ln.partition("=")
        out.setdefault(section, []).append((k.strip(), v.strip()))
    return out


def unit_value(key: str) -> str:
    return next(v for k, v in unit()["Service"] if k == key)


def systemd_deployed() -> Deployed:
    env = dict(shlex.split(v)[0].split("=", 1) for k, v in unit()["Service"]
               if k == "Environment")
    exe, sub, *argv = shlex.split(unit_value("ExecStart"))
    assert exe.endswith("/qosgate") and sub == "serve"
    return Deployed(argv, env, set())


FLAVOURS = {"container": container_deployed, "kubernetes": k8s_deployed,
            "systemd": systemd_deployed}
