"""A fleet that fails under load: 3 stand-in replicas behind the gateway, a steady mixed-class
streaming load, one replica killed (SIGKILL) and later another one hung.

    .venv/bin/python bench/fleet_faults.py [--quick] [--rate R] [--seed N]

A benchmark, not a test: it prints what happened. Timeline (seconds from the start of the load;
``--quick`` halves it):

    0 ............ KILL_AT (40) ............ HANG_AT (80) ............ END (120), then drain
                   kill -9 of replica r1     r2 hangs before its first byte (POST /admin/fault)

The load is open-loop (Poisson arrivals, ``--rate`` per second, default 8), every request
streaming, 30% realtime, 30% api, 20% batch, 20% offline, with class-typical prompt and output
lengths; 0.25 s before the kill a burst of 30 more arrives at once, so that the kill finds
requests that have not streamed anything yet (in steady load a request spends only one engine
step or two in that state, and the kill would find almost none). The
stand-ins run the simulated H100 eight times slower than modelled (``--time-scale 8``: ~16
tokens/s per stream), so that requests stay in flight for seconds while the whole run costs
the shared machine little CPU. The client is a minimal HTTP/1.1 client (httptools), one
connection per request, which timestamps the first SSE event in the socket callback.

Every request carries a marker in its message; each stand-in records the bodies it received
(``--record``), which is how the bench knows which requests a fault hit:

- **requests lost**: requests the client saw no single, well-formed outcome for (no response,
  a connection broken without an answer, or still open at the end), and the difference between
  the requests sent and the outcomes the gateway counted (``qosgate_requests_total``);
- **kill**: the requests r1 had received that were still open at the kill; those that had not
  streamed anything yet should complete on another replica (goal >= 99%); those already
  streaming cannot be retried and should end with an OpenAI-format error event;
- **hang**: the requests r2 received while it hung (those sent after the hang began that reached
  it); they should complete elsewhere after their class's first-byte bound;
- **realtime TTFT p99** (arrival to the first SSE event) by arrival span: before, during (the
  first 15 s) and after each fault;
- **time to eject**: from the fault to the gateway's metrics showing the replica out of use
  (``qosgate_replica_eligible`` 0; for the hung one ``qosgate_replica_breaker_open`` 1), polled
  every 0.2 s;
- outcomes, as the client saw them and as the gateway counted them, and the gateway's
  attempt failures and retries by replica and reason.

First-byte bounds per class (``first_byte_timeout_s``): realtime 2 s, api 5 s, batch and offline
10 s; the fleet section (retry budget, outlier detection) is the gateway's default.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import uvloop

from qosgate import config as qconfig

PY = sys.executable
MODEL = "Qwen/Qwen2.5-7B-Instruct"
# (class, share, output tokens, prompt characters)
CLASSES = (("realtime", 0.3, (16, 48), (100, 400)), ("api", 0.3, (32, 96), (400, 2000)),
           ("batch", 0.2, (64, 160), (1000, 4000)), ("offline", 0.2, (64, 160), (1000, 4000)))
BURST = 30  # requests sent at once just before the kill
BURST_LEAD_S = 0.25
FIRST_BYTE_S = {"realtime": 2.0, "api": 5.0, "batch": 10.0, "offline": 10.0}
DURING_S = 15.0  # the "during" window after a fault


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def start(args: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    f = log.open("wb")
    proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args} exited: {log.read_text()}")
        try:
            get(url, 1)
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{args} did not start: {log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in get(url + "/metrics").decode().splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels: dict[str, str] = {}
        if rest:
            for part in rest.rstrip("}").split('",'):
                k, _, v = part.partition("=")
                if k:
                    labels[k] = v.strip('"')
        out.setdefault(name, []).append((labels, float(value)))
    return out


def one_value(m: dict[str, list[tuple[dict[str, str], float]]], name: str,
              **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    return sum(v for lb, v in m.get(name, []) if all(lb.get(k) == x for k, x in labels.items()))


def gauge(m: dict[str, list[tuple[dict[str, str], float]]], name: str, replica: str) -> float:
    return sum(v for lb, v in m.get(name, []) if lb.get("replica") == replica)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


# ---------------------------------------------------------------------- the client
@dataclass(slots=True)
class Rec:
    i: int
    cls: str
    max_tokens: int
    prompt_chars: int = 100
    sent: float = 0.0
    first: float | None = None  # the first SSE event of a 200 (not a keep-alive comment)
    end: float | None = None
    status: int = 0
    outcome: str = "unresolved"  # completed | error_event:<code> | http_<status>:<code> | ...
    retry_after_ms: str | None = None  # the answer's headers, as sent, for a client's retry
    retry_after: str | None = None


class _Resp(asyncio.Protocol):
    """One request on its own connection; resolves ``done`` once with the outcome set."""

    def __init__(self, rec: Rec, done: asyncio.Future[None]) -> None:
        self.rec = rec
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.tail = b""
        self.body = b""
        self.now = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._end("transport:bad_http")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"retry-after-ms":
            self.rec.retry_after_ms = value.decode("latin-1")
        elif name == b"retry-after":
            self.rec.retry_after = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.rec.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        rec = self.rec
        if rec.status == 200:
            # the first event, not the gateway's ": keep-alive" comments (a stream queued for
            # a while gets its head and comments early)
            if rec.first is None and b"data:" in body:
                rec.first = self.now
            self.tail = (self.tail + body)[-4096:]
        else:
            self.body += body

    def on_message_complete(self) -> None:
        rec = self.rec
        if rec.status != 200:
            try:
                code = json.loads(self.body)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "?"
            self._end(f"http_{rec.status}:{code}")
            return
        k = self.tail.rfind(b'data: {"error"')
        if k >= 0:
            try:
                code = json.loads(self.tail[k + 6:].split(b"\n\n")[0])["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "?"
            self._end(f"error_event:{code}")
        elif b"data: [DONE]" in self.tail:
            self._end("completed")
        else:
            self._end("truncated")

    def connection_lost(self, exc: Exception | None) -> None:
        self._end("transport:" + ("no_answer" if self.rec.status == 0 else "cut"))

    def _end(self, outcome: str) -> None:
        if self.done.done():
            return
        self.rec.outcome = outcome
        self.rec.end = time.monotonic()
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


def request_bytes(port: int, rec: Rec, model: str = MODEL) -> bytes:
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": rec.max_tokens,
        "messages": [{"role": "user", "content": f"bench-{rec.i} " + "x" * rec.prompt_chars}],
    }).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nx-qos-class: {rec.cls}\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def one(port: int, rec: Rec, model: str = MODEL, timeout: float | None = None) -> None:
    """Send ``rec`` and wait for its outcome; ``timeout``: a client that gives up that many
    seconds after sending (outcome ``client_timeout``). Cancelled, it disconnects, as a client
    that leaves."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    rec.sent = time.monotonic()
    try:
        transport, resp = await loop.create_connection(lambda: _Resp(rec, done), "127.0.0.1",
                                                       port)
    except OSError as exc:
        rec.outcome, rec.end = f"transport:{type(exc).__name__}", time.monotonic()
        return
    transport.write(request_bytes(port, rec, model))
    try:
        if timeout is None:
            await done
        else:
            await asyncio.wait_for(asyncio.shield(done), rec.sent + timeout - time.monotonic())
    except TimeoutError:
        resp._end("client_timeout")
    finally:
        transport.close()


# ---------------------------------------------------------------------- the run
def gateway_config(path: Path, urls: list[str], capacity: int,
                   budget_percent: float | None) -> dict[str, Any]:
    classes = []
    for c in qconfig.default_config().classes:
        d = c.model_dump(exclude_none=True)
        if "first_byte_timeout_s" in qconfig.ServiceClass.model_fields:
            d["first_byte_timeout_s"] = FIRST_BYTE_S[c.name]
        classes.append(d)
    cfg: dict[str, Any] = {
        "classes": classes,
        "upstreams": [{"url": u, "name": f"r{i}", "max_window": capacity,
                       "priority_polarity": "vllm"} for i, u in enumerate(urls)],
    }
    if budget_percent is not None:
        cfg["fleet"] = {"retries": {"budget_percent": budget_percent}}
    path.write_text(json.dumps(cfg, indent=1))
    return cfg


def new_request(rng: random.Random, i: int) -> Rec:
    r = rng.random()
    for name, w, (lo, hi), (plo, phi) in CLASSES:
        r -= w
        if r <= 0 or name == CLASSES[-1][0]:
            return Rec(i, name, rng.randint(lo, hi), rng.randint(plo, phi))
    raise AssertionError


def markers(path: Path) -> set[int]:
    out: set[int] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            body = json.loads(base64.b64decode(json.loads(line)["body"]))
            if "messages" in body:  # (not a continuation: token ids, no marker)
                out.add(int(body["messages"][0]["content"].split()[0].split("-")[1]))
    return out


async def run(args: argparse.Namespace, tmp: Path) -> None:
    scale = 0.5 if args.quick else 1.0
    kill_at, hang_at, end_at = 40 * scale, 80 * scale, 120 * scale
    rng = random.Random(args.seed)
    records = [tmp / f"rec-{i}.jsonl" for i in range(3)]
    ports = [free_port() for _ in range(3)]
    sis = [
        start([PY, "-m", "qosgate.standin", "--port", str(p), "--scheduling-policy",
               "priority", "--time-scale", str(args.time_scale), "--record", str(records[i])],
              f"http://127.0.0.1:{p}/health", tmp / f"standin-{i}.log")
        for i, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    gport = free_port()
    cfg_path = tmp / "gateway.yaml"
    gateway_config(cfg_path, urls, args.capacity, args.retry_budget)
    gw_url = f"http://127.0.0.1:{gport}"
    gw = start([PY, "-m", "qosgate.cli", "serve", "--port", str(gport), "--config",
                str(cfg_path), "--log-level", "warning"], gw_url + "/readyz", tmp / "gateway.log")
    written = json.loads(cfg_path.read_text())
    fleet = qconfig.config_from_mapping(
        {k: v for k, v in written.items() if k in ("classes", "fleet")}).fleet
    print(f"3 stand-ins (x{args.time_scale} slower than the modelled H100), gateway window "
          f"{args.capacity} each, router {fleet.router}; retry budget "
          f"{fleet.retries.budget_percent:g}% (min {fleet.retries.min_retries}), "
          f"{fleet.retries.max_attempts} attempts; outlier: "
          f"{fleet.outlier.consecutive_failures} consecutive failures, "
          f"{fleet.outlier.base_ejection_s:g} s base ejection")
    print(f"load: {args.rate:g} req/s Poisson, all streaming, "
          + ", ".join(f"{n} {int(w * 100)}% ({lo}-{hi} tokens, {plo}-{phi} prompt chars)"
                      for n, w, (lo, hi), (plo, phi) in CLASSES)
          + "; first-byte bounds " + ", ".join(f"{k} {v:g} s" for k, v in FIRST_BYTE_S.items()))
    print(f"timeline: a burst of {BURST} requests at {kill_at - BURST_LEAD_S:g} s, kill -9 r1 at "
          f"{kill_at:g} s, r2 hangs at {hang_at:g} s, load ends at {end_at:g} s", flush=True)

    recs: list[Rec] = []
    tasks: list[asyncio.Task[None]] = []
    events: dict[str, float] = {}
    base_m = metrics(gw_url)
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()

    async def watch() -> None:
        """Poll the gateway's replica gauges: when each faulted replica went out of use."""
        while True:
            await asyncio.sleep(0.2)
            try:
                m = await asyncio.to_thread(metrics, gw_url)
            except OSError:
                continue
            now = time.monotonic()
            if "kill" in events and "r1_out" not in events and \
                    gauge(m, "qosgate_replica_eligible", "r1") == 0:
                events["r1_out"] = now
            if "kill" in events and "r1_down" not in events and \
                    gauge(m, "qosgate_replica_up", "r1") == 0:
                events["r1_down"] = now
            if "hang" in events and "r2_ejected" not in events and \
                    gauge(m, "qosgate_replica_breaker_open", "r2") == 1:
                events["r2_ejected"] = now
            if "hang" in events and "r2_back" not in events and "r2_ejected" in events and \
                    gauge(m, "qosgate_replica_breaker_open", "r2") == 0:
                events["r2_back"] = now
            if "r2_back" in events and "r2_again" not in events and \
                    gauge(m, "qosgate_replica_breaker_open", "r2") == 1:
                events["r2_again"] = now

    watcher = loop.create_task(watch())
    i = 0

    def send(n: int) -> None:
        nonlocal i
        for _ in range(n):
            rec = new_request(rng, i)
            recs.append(rec)
            tasks.append(loop.create_task(one(gport, rec)))
            i += 1

    async def at(t: float) -> None:
        await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))

    async def timeline() -> None:
        await at(kill_at - BURST_LEAD_S)
        send(BURST)
        events["burst"] = time.monotonic()
        await at(kill_at)
        sis[1].send_signal(signal.SIGKILL)
        events["kill"] = time.monotonic()
        await at(hang_at)
        req = urllib.request.Request(urls[2] + "/admin/fault", method="POST",
                                     data=b'{"fault": "hang-first-byte"}')
        await asyncio.to_thread(urllib.request.urlopen, req, None, 5)
        events["hang"] = time.monotonic()

    faults = loop.create_task(timeline())
    next_at = t0
    while True:
        next_at += rng.expovariate(args.rate)
        if next_at - t0 >= end_at:
            break
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        send(1)
    await faults
    load_end = time.monotonic()
    print(f"load done: {len(recs)} requests in {load_end - t0:.0f} s; draining", flush=True)
    _, pending = await asyncio.wait(tasks, timeout=args.drain)
    for t in pending:
        t.cancel()
    watcher.cancel()
    end_m = metrics(gw_url)
    hung_hits = int(json.loads(get(urls[2] + "/admin/fault"))["hits"].get("hang-first-byte", 0))
    stop(gw)
    for s in sis:
        stop(s)
    report(recs, events, t0, kill_at, hang_at, end_at, records, base_m, end_m, hung_hits)
    if args.keep:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            f.replace(keep / f.name)
        (keep / "requests.jsonl").write_text("".join(
            json.dumps({k: getattr(r, k) for k in Rec.__slots__}) + "\n" for r in recs))
        (keep / "events.json").write_text(json.dumps({k: v - t0 for k, v in events.items()}))


def report(recs: list[Rec], ev: dict[str, float], t0: float, kill_at: float, hang_at: float,
           end_at: float, records: list[Path], base_m: Any, end_m: Any,
           hung_hits: int) -> None:
    kill_t, hang_t = ev["kill"], ev["hang"]
    at = [markers(p) for p in records]
    by_id = {r.i: r for r in recs}
    ok = {"completed"}
    print()
    # ---- lost
    well_formed = [r for r in recs if r.outcome == "completed" or r.outcome.startswith(
        ("error_event:", "http_"))]
    lost = len(recs) - len(well_formed)
    gw_out: Counter[tuple[str, str]] = Counter()
    for lb, v in end_m.get("qosgate_requests_total", []):
        gw_out[(lb["outcome"], lb["reason"])] += int(v)
    for lb, v in base_m.get("qosgate_requests_total", []):
        gw_out[(lb["outcome"], lb["reason"])] -= int(v)
    gw_total = sum(gw_out.values())
    print(f"{'requests sent':<58}{len(recs):>8}")
    print(f"{'requests lost (client: no single well-formed outcome)':<58}{lost:>8}   goal 0")
    print(f"{'outcomes counted by the gateway - requests sent':<58}{gw_total - len(recs):>8}"
          "   goal 0")

    # ---- kill
    open_at_kill = [r for r in recs if r.sent <= kill_t and (r.end is None or r.end > kill_t)]
    quiet = [r for r in open_at_kill if r.first is None or r.first > kill_t]
    quiet_ok = [r for r in quiet if r.outcome in ok]
    quiet_r1 = [r for r in quiet if r.i in at[1]]
    quiet_r1_ok = [r for r in quiet_r1 if r.outcome in ok and (r.i in at[0] or r.i in at[2])]
    streaming = [r for r in open_at_kill if r.i in at[1] and r not in quiet]
    stream_err = [r for r in streaming if r.outcome.startswith("error_event:")]
    after_kill = [r for r in recs if kill_t < r.sent < hang_t]
    print()
    print(f"kill -9 of r1 at {kill_t - t0:.1f} s: {len(open_at_kill)} requests open, "
          f"{len(quiet)} of them not streaming yet; completed {len(quiet_ok)} "
          f"({_share(len(quiet_ok), len(quiet))}, goal >= 99%)")
    print(f"    of these, at r1 when it died: {len(quiet_r1)}, completed elsewhere "
          f"{len(quiet_r1_ok)} ({_share(len(quiet_r1_ok), len(quiet_r1))}); the others were "
          f"queued at the gateway or at another replica")
    print(f"    streaming from r1 when it died: {len(streaming)}, ended with an OpenAI error event "
          f"{len(stream_err)}; other endings: "
          f"{dict(Counter(r.outcome for r in streaming if r not in stream_err)) or 'none'}")
    print(f"    arrivals after the kill (until the hang): {len(after_kill)}, completed "
          f"{_share(sum(r.outcome in ok for r in after_kill), len(after_kill))}")
    # ---- hang
    # what r2 received and did not serve: it fails only by hanging, and r0 never fails
    hit = [i for i in at[2] - at[1] if (by_id[i].end or math.inf) > hang_t
           and (i in at[0] or by_id[i].outcome not in ok)]
    hit_ok = [i for i in hit if by_id[i].outcome in ok and i in at[0]]
    after_hang = [r for r in recs if r.sent >= hang_t]
    print(f"r2 hangs at {hang_t - t0:.1f} s: requests it held without a byte {len(hit)} (its own "
          f"count: {hung_hits} attempts), completed elsewhere {len(hit_ok)} "
          f"({_share(len(hit_ok), len(hit))}, goal >= 99%)")
    print(f"    arrivals after the hang: {len(after_hang)}, completed "
          f"{_share(sum(r.outcome in ok for r in after_hang), len(after_hang))}")

    # ---- ejection
    print()

    def since(key: str, ref: float) -> str:
        return f"{ev[key] - ref:.2f} s" if key in ev else "never (in the run)"

    print(f"killed r1 out of use (eligible 0) after {since('r1_out', kill_t)}, "
          f"probe says down (up 0) after {since('r1_down', kill_t)}")
    print(f"hung r2 ejected (breaker open) after {since('r2_ejected', hang_t)}; "
          f"back on trial after {since('r2_back', hang_t)}, ejected again after "
          f"{since('r2_again', hang_t)}")

    # ---- realtime TTFT
    print()
    windows = [
        ("before the kill", 5.0, kill_at),
        ("during the kill (15 s)", kill_at, kill_at + DURING_S),
        ("after the kill", kill_at + DURING_S, hang_at),
        ("during the hang (15 s)", hang_at, hang_at + DURING_S),
        ("after the hang", hang_at + DURING_S, end_at),
    ]
    print(f"{'realtime TTFT (arrival to first event)':<40}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}"
          f"{'max ms':>10}{'not completed':>15}")
    for label, lo, hi in windows:
        rt = [r for r in recs if r.cls == "realtime" and lo <= r.sent - t0 < hi]
        ttft = [(r.first - r.sent) * 1000 for r in rt if r.first is not None]
        cells = [pct(ttft, 50), pct(ttft, 99), max(ttft) if ttft else None]
        print(f"{label:<40}{len(rt):>6}" + "".join(
            f"{'-' if c is None else f'{c:.0f}':>10}" for c in cells)
            + f"{sum(r.outcome not in ok for r in rt):>15}")

    # ---- outcomes
    print()
    print("outcomes, client side:")
    for (cls, out), n in sorted(Counter((r.cls, r.outcome) for r in recs).items()):
        print(f"    {cls:<10}{out:<44}{n:>6}")
    print("outcomes, gateway (qosgate_requests_total, this run):")
    for (out, reason), n in sorted(gw_out.items()):
        if n:
            print(f"    {out:<12}{reason:<42}{n:>6}")
    print("attempts failed before the first byte / retried elsewhere (gateway):")
    fails: Counter[tuple[str, str]] = Counter()
    retries: Counter[tuple[str, str]] = Counter()
    for name, acc in (("qosgate_attempt_failures_total", fails), ("qosgate_retries_total",
                                                                  retries)):
        for lb, v in end_m.get(name, []):
            acc[(lb["replica"], lb["reason"])] += int(v)
        for lb, v in base_m.get(name, []):
            acc[(lb["replica"], lb["reason"])] -= int(v)
    for key in sorted(fails):
        print(f"    {key[0]:<6}{key[1]:<40}{fails[key]:>6}{retries[key]:>8}")


def _share(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="half the timeline (60 s of load)")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second")
    p.add_argument("--time-scale", type=float, default=8.0, help="stand-in slowdown")
    p.add_argument("--capacity", type=int, default=48, help="gateway window per replica")
    p.add_argument("--drain", type=float, default=60.0, help="seconds to wait at the end")
    p.add_argument("--retry-budget", type=float, default=None, metavar="PCT",
                   help="fleet.retries.budget_percent (default: the gateway's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="keep the logs, records and per-request results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-faults-") as d:
        uvloop.run(run(args, Path(d)))


if __name__ == "__main__":
    main()
