"""Fault switches for the vLLM stand-in: make one replica of a test fleet misbehave, on purpose.

Tests and benchmarks switch a fault on from the command line (``--fault SPEC``, repeatable;
``--slow FACTOR``) or at run time (``POST /admin/fault``), and off again (``DELETE /admin/fault``).
A spec is a kind followed by ``:key=value`` options::

    die[:after=S]                       exit at once (SIGKILL to itself, as ``kill -9``), or in S s
    refuse[:for=S]                      stop listening (connections refused) and drop the open
                                        connections, as a crashed process; listen again after S s
                                        (without ``for``: until the process ends)
    hang-first-byte                     accept a request, read it, never answer (the connection
                                        stays open until the client leaves)
    hang-mid-stream[:after=N]           stream N content chunks (default 1), then send nothing more,
                                        the connection kept open; a non-streamed request hangs
                                        before its answer
    slow:factor=F   (or --slow F)       every engine step takes F times as long
    429[:retry-after=S] / 503[:...]     answer every generation request with that status and
                                        ``Retry-After: S`` (default 1; ``retry-after=none``: no
                                        header), in vLLM's error format
    500                                 answer every generation request with an engine failure
                                        (no ``Retry-After``)

and, for every kind but ``die``/``refuse``, ``for=S`` (it clears itself after S seconds),
``at=S`` (it starts S seconds from now) and, for the per-request ones (``hang-*``, ``429``,
``503``, ``500``), ``count=N`` (only the next N generation requests). One fault of each kind is
active at a time (429, 503 and 500 share one slot); switching one on replaces the one of its
kind. Health
(``/health``, ``/v1/models``), ``/metrics`` and the admin and debug routes are never affected:
a hung engine whose model list still answers is exactly what outlier detection is for.

The JSON form of ``POST /admin/fault`` is either ``{"fault": "<spec>"}`` or the kind with its
options as members: ``{"fault": "429", "retry_after": 2, "for": 10}``. ``GET /admin/fault``
lists the active faults and how many requests each one has hit.

This module is the pure part (parsing, what is active when; the clock is passed in); the
stand-in applies it (``standin/server.py``), and ``Listener`` stops and restarts uvicorn's
listening sockets for ``refuse``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn

KINDS = ("die", "refuse", "hang-first-byte", "hang-mid-stream", "slow", "429", "503", "500")
PROCESS_KINDS = frozenset({"die", "refuse"})  # acted on once, not a state requests consult
STATUS_KINDS = frozenset({"429", "503", "500"})  # answered with that HTTP status (one slot)
_PER_REQUEST = frozenset({"hang-first-byte", "hang-mid-stream", *STATUS_KINDS})
_OPTIONS: dict[str, frozenset[str]] = {
    "die": frozenset({"after"}),
    "refuse": frozenset({"for", "at"}),
    "hang-first-byte": frozenset({"for", "at", "count"}),
    "hang-mid-stream": frozenset({"after", "for", "at", "count"}),
    "slow": frozenset({"factor", "for", "at"}),
    "429": frozenset({"retry-after", "for", "at", "count"}),
    "503": frozenset({"retry-after", "for", "at", "count"}),
    "500": frozenset({"for", "at", "count"}),
}


class FaultError(ValueError):
    """A fault spec that cannot be understood."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    after: float | None = None  # die: seconds before exiting; hang-mid-stream: chunks sent first
    for_s: float | None = None  # clears itself after this long (None: until switched off)
    at_s: float = 0.0  # starts this long after being switched on
    retry_after: float | None = 1.0  # 429/503: the Retry-After header (None: no header)
    factor: float = 1.0  # slow
    count: int | None = None  # per-request kinds: the next N requests only

    @property
    def slot(self) -> str:
        return "status" if self.kind in STATUS_KINDS else self.kind

    @property
    def chunks(self) -> int:
        """hang-mid-stream: content chunks that still reach the client."""
        return 1 if self.after is None else int(self.after)

    def spec(self) -> str:
        """The fault as a spec string (``parse_fault(f.spec()) == f``)."""
        parts = [self.kind]
        if self.kind == "slow":
            parts.append(f"factor={_num(self.factor)}")
        if self.kind in ("429", "503"):
            ra = self.retry_after
            parts.append("retry-after=" + ("none" if ra is None else _num(ra)))
        if self.after is not None:
            parts.append(f"after={_num(self.after)}")
        if self.for_s is not None:
            parts.append(f"for={_num(self.for_s)}")
        if self.at_s:
            parts.append(f"at={_num(self.at_s)}")
        if self.count is not None:
            parts.append(f"count={self.count}")
        return ":".join(parts)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _seconds(key: str, value: object) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FaultError(f"{key} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise FaultError(f"{key} must be >= 0, got {value!r}")
    return x


def _build(kind: str, opts: Mapping[str, object]) -> Fault:
    if kind not in KINDS:
        raise FaultError(f"unknown fault {kind!r} (known: {', '.join(KINDS)})")
    allowed = _OPTIONS[kind]
    for key in opts:
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise FaultError(f"fault {kind!r} takes no option {key!r} (its options: {known})")
    f = Fault(kind, retry_after=None) if kind == "500" else Fault(kind)
    if "after" in opts:
        after = _seconds("after", opts["after"])
        if kind == "hang-mid-stream" and not float(after).is_integer():
            raise FaultError(f"after must be a whole number of chunks, got {opts['after']!r}")
        f = replace(f, after=after)
    if "for" in opts:
        f = replace(f, for_s=_seconds("for", opts["for"]))
    if "at" in opts:
        f = replace(f, at_s=_seconds("at", opts["at"]))
    if "retry-after" in opts:
        ra = opts["retry-after"]
        none = ra is None or (isinstance(ra, str) and ra.lower() == "none")
        f = replace(f, retry_after=None if none else _seconds("retry-after", ra))
    if "count" in opts:
        c = opts["count"]
        if isinstance(c, int) and not isinstance(c, bool):
            n = c
        elif isinstance(c, str) and c.strip().isdigit():
            n = int(c)
        else:
            n = 0
        if n < 1:
            raise FaultError(f"count must be a whole number >= 1, got {c!r}")
        f = replace(f, count=n)
    if kind == "slow":
        if "factor" not in opts:
            raise FaultError("slow needs a factor (slow:factor=3)")
        factor = _seconds("factor", opts["factor"])
        if factor <= 0:
            raise FaultError("the slow factor must be > 0")
        f = replace(f, factor=factor)
    return f


def _split(spec: str) -> tuple[str, dict[str, object]]:
    head, *rest = spec.strip().split(":")
    opts: dict[str, object] = {}
    for part in rest:
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise FaultError(f"bad option {part!r} in fault {spec!r} (expected key=value)")
        opts[key.strip().lower()] = value.strip()
    return head.strip().lower(), opts


def parse_fault(spec: str) -> Fault:
    """``KIND[:key=value]...`` (see the module doc); raises ``FaultError``."""
    return _build(*_split(spec))


def fault_from_json(doc: object) -> Fault:
    """The body of ``POST /admin/fault``: ``{"fault": "<spec>"}``, or the kind with its options
    as members (``retry_after`` or ``retry-after``, ``for``, ``at``, ``after``, ``count``,
    ``factor``); a member overrides the same option in the spec."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("fault"), str):
        raise FaultError('expected a JSON object with a "fault" string')
    kind, opts = _split(doc["fault"])
    opts.update({str(k).replace("_", "-"): v for k, v in doc.items() if k != "fault"})
    return _build(kind, opts)


@dataclass(slots=True)
class _Active:
    fault: Fault
    start: float
    until: float
    left: int | None


class FaultSwitch:
    """The faults a stand-in has on: switched on and off, started and expired by time, used up
    by requests. No I/O: every method takes ``now`` (``clock()`` when omitted)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._on: dict[str, _Active] = {}
        self.hits: Counter[str] = Counter()  # requests each kind has affected

    @property
    def armed(self) -> bool:
        """Any fault switched on (active, pending or expired but not yet noticed)."""
        return bool(self._on)

    # ---- switching
    def set(self, fault: Fault, now: float | None = None) -> None:
        if fault.kind in PROCESS_KINDS:
            raise FaultError(f"{fault.kind!r} is acted on by the stand-in, not switched on")
        t = self.clock() if now is None else now
        start = t + fault.at_s
        until = start + fault.for_s if fault.for_s is not None else math.inf
        self._on[fault.slot] = _Active(fault, start, until, fault.count)

    def clear(self, kind: str | None = None) -> int:
        """Switch off the fault of ``kind`` (all of them if None); how many were on."""
        if kind is None:
            n = len(self._on)
            self._on.clear()
            return n
        slot = "status" if kind in STATUS_KINDS else kind
        return 1 if self._on.pop(slot, None) is not None else 0

    def _get(self, slot: str, now: float | None) -> _Active | None:
        a = self._on.get(slot)
        if a is None:
            return None
        t = self.clock() if now is None else now
        if t >= a.until:
            del self._on[slot]
            return None
        return a if t >= a.start else None

    def _take(self, slot: str, now: float | None) -> Fault | None:
        """The fault in ``slot`` if it applies to one more request (its count goes down)."""
        a = self._get(slot, now)
        if a is None:
            return None
        if a.left is not None:
            a.left -= 1
            if a.left <= 0:
                del self._on[slot]
        self.hits[a.fault.kind] += 1
        return a.fault

    # ---- what a request meets (each call counts as one request affected)
    def take_status(self, now: float | None = None) -> Fault | None:
        """A 429/503/500 fault to answer this request with, if one is on."""
        return self._take("status", now)

    def take_hang(self, now: float | None = None) -> bool:
        return self._take("hang-first-byte", now) is not None

    def take_mid_stream(self, now: float | None = None) -> int | None:
        """The content chunks this request may still send before it hangs, if it will."""
        f = self._take("hang-mid-stream", now)
        return None if f is None else f.chunks

    def slow_factor(self, now: float | None = None) -> float:
        a = self._get("slow", now)
        return 1.0 if a is None else a.fault.factor

    def next_change(self, now: float | None = None) -> float | None:
        """When a fault starts or ends by itself next (after ``now``), or None."""
        t = self.clock() if now is None else now
        times = [x for a in self._on.values() for x in (a.start, a.until) if t < x < math.inf]
        return min(times) if times else None

    def describe(self, now: float | None = None) -> list[dict[str, Any]]:
        t = self.clock() if now is None else now
        out: list[dict[str, Any]] = []
        for slot in list(self._on):
            a = self._on[slot]
            if t >= a.until:
                del self._on[slot]
                continue
            out.append({
                "fault": a.fault.spec(),
                "kind": a.fault.kind,
                "active": t >= a.start,
                "starts_in_s": round(max(0.0, a.start - t), 3),
                "ends_in_s": None if a.until == math.inf else round(a.until - t, 3),
                "requests_left": a.left,
            })
        return out


class Listener:
    """Stops and restarts a running uvicorn server's listening sockets (``refuse``): while
    stopped, a connection attempt is refused (the port has no listener), as a crashed engine's
    is; the connections open at that moment are dropped."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.refusing = False

    def refuse(self, for_s: float | None) -> None:
        srv = self.server
        for s in srv.servers:
            s.close()
        srv.servers = []
        for proto in list(srv.server_state.connections):
            transport = getattr(proto, "transport", None)
            if transport is not None:
                transport.abort()
        self.refusing = True
        if for_s is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(for_s, lambda: loop.create_task(self.listen()))

    async def listen(self) -> None:
        """Listen again on the configured host and port."""
        srv = self.server
        cfg = srv.config
        loop = asyncio.get_running_loop()

        def factory(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            proto: asyncio.Protocol = cfg.http_protocol_class(  # type: ignore[call-arg]
                config=cfg, server_state=srv.server_state, app_state=srv.lifespan.state,
                _loop=_loop,
            )
            return proto

        s = await loop.create_server(factory, host=cfg.host, port=cfg.port, backlog=cfg.backlog)
        srv.servers.append(s)
        self.refusing = False
