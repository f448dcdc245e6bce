"""Abuse beside a steady realtime stream: does anything get past the gateway, does anything crash
it, and what does the abuse cost the well-behaved?

    .venv/bin/python bench/abuse.py [--baseline 15] [--abuse 40] [--slow 300] [--fd-limit 256]

A gateway (the simulated GPU engine at real speed, no model) runs with a descriptor limit of
``--fd-limit`` (soft and hard, as a container would set it), a header timeout of 5 s and a body
timeout of 10 s. A realtime client in a process of its own sends one streamed chat request
(``x-qos-class: realtime``, 8 tokens) every 250 ms on one kept-alive connection, and measures the
time to its first token (TTFT). First alone (baseline), then beside three kinds of abuse, all
with ``Connection: close``, started together and kept up for ``--abuse`` seconds:

- **slow clients** (slowloris): ``--slow`` sockets held open at all times, a third sending
  nothing, a third dripping a request head one byte a second, a third a full head and then the
  body one byte a second; each one the gateway closes is replaced at once;
- **a fuzz storm**: ``--fuzzers`` clients in closed loops sending mutated requests (wrong types,
  malformed messages, duplicated and escaped keys, cut short, corrupted, invalid UTF-8, nested
  thousands deep, 256 KiB bodies, junk headers) as fast as they are answered;
- **a flood of disconnects**: ``--disconnectors`` clients in closed loops sending a streamed
  request (200 tokens, asking for priority 0, above its classes) and hanging up right after
  sending it, after the response head, or after the first token.

The realtime client is tenant ``rt``; the fuzzers and disconnectors use tenant ``abuser``'s key
(clamped to batch/offline: a class named outside them is a 403, a priority above them is
clamped), or a bad key or none.

Reported: realtime TTFT p50/p99 with and without the abuse; the gateway's open descriptors and
RSS (idle, peak under abuse, after); how the abuse was answered; 5xx answers that are not the
connection cap's shedding (goal 0); and requests without an outcome (goal 0): every abusive
connection and every realtime request must appear exactly once in /metrics, in
``qosgate_requests_total`` or, for a connection closed before it carried a whole request head,
in ``qosgate_connections_refused_total``.

This is a benchmark: it prints numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PY = sys.executable
QOSGATE = [PY, "-m", "qosgate.cli"]
ADMIN = "sk-admin"
CONFIG = """
tenants:
  - {name: rt, api_keys: [sk-rt], tier: pro}
  # the abusers: a tenant clamped to batch/offline, as an untrusted one would be
  - {name: abuser, api_keys: [sk-abuse], tier: free, allowed_classes: [batch, offline]}
server:
  admin_keys: [sk-admin]
  header_timeout_s: 5
  body_timeout_s: 10
engine: {kind: sim, eos_after: 16}
"""
HI = [{"role": "user", "content": "Say hello."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- the gateway
def start_gateway(port: int, fd_limit: int, workdir: Path) -> subprocess.Popen[bytes]:
    cfg = workdir / "abuse.yaml"
    cfg.write_text(CONFIG)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    log = (workdir / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [*QOSGATE, "serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(
            f"http://127.0.0.1:{port}/readyz", timeout=1
        ) as r:
            if r.status == 200:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the gateway did not start: " + (workdir / "gateway.log").read_text())


def scrape(port: int) -> tuple[float, Counter[str], dict[str, float]]:
    """(requests with an outcome, connections refused by reason, the realtime TTFT histogram's
    cumulative bucket counts as the gateway measured it: arrival to first token)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    refused: Counter[str] = Counter()
    ttft: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("qosgate_ttft_seconds_bucket{") and 'class="realtime"' in line:
            le = re.search(r'le="([^"]+)"', line)
            if le:
                ttft[le.group(1)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("qosgate_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("qosgate_connections_refused_total{"):
            m = re.search(r'reason="([^"]+)"', line)
            if m:
                refused[m.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return total, refused, ttft


def ttft_share(before: dict[str, float], after: dict[str, float]) -> str:
    """Of the realtime requests between two scrapes, the share whose in-gateway TTFT was within
    25 ms / 100 ms / 1 s, from the histogram."""
    n = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    if not n:
        return "-"
    parts = []
    for le in ("0.025", "0.1", "1.0"):
        k = after.get(le, 0.0) - before.get(le, 0.0)
        parts.append(f"{100 * k / n:.0f}%")
    return " / ".join(parts)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fds_and_rss(pid: int) -> tuple[int, float]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return fds, rss


# ---------------------------------------------------------------------- the realtime stream
def realtime_client(port: int, seconds: float, every: float, out: mp.Queue) -> None:
    """One kept-alive connection, one streamed realtime request every ``every`` s; TTFTs to
    ``out`` (seconds; -status for a failed request)."""
    body = json.dumps({"messages": HI, "max_tokens": 8, "stream": True}).encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
           b"Authorization: Bearer sk-rt\r\nx-qos-class: realtime\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    results: list[float] = []
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    end = time.monotonic() + seconds
    nxt = time.monotonic()
    buf = b""
    while time.monotonic() < end:
        nxt += every
        t0 = time.monotonic()
        sock.sendall(req)
        first: float | None = None
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit("the gateway closed the realtime connection")
            buf += chunk
            if first is None and b"data: {" in buf:
                first = time.monotonic() - t0
            if buf.startswith(b"HTTP/1.1 ") and not buf.startswith(b"HTTP/1.1 200"):
                results.append(-float(buf[9:12]))
                buf = b""
                sock.close()
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            if b"0\r\n\r\n" in buf and b"[DONE]" in buf:  # the chunked stream's end
                results.append(first if first is not None else -1.0)
                buf = b""
                break
        time.sleep(max(0.0, nxt - time.monotonic()))
    sock.close()
    out.put(results)


def run_realtime(port: int, seconds: float) -> list[float]:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=realtime_client, args=(port, seconds, 0.25, q))
    p.start()
    res: list[float] = q.get(timeout=seconds + 120)
    p.join(30)
    return res


# ---------------------------------------------------------------------- the abuse
@dataclass
class Tally:
    connections: int = 0  # abusive connections opened (each one carries at most one request)
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    resets: int = 0
    refused_at_connect: int = 0  # the kernel refused it (backlog full): nothing to count

    def answer(self, raw: bytes) -> None:
        if not raw.startswith(b"HTTP/1.1 "):
            self.resets += 1
            return
        status = int(raw[9:12])
        self.statuses[status] += 1
        m = re.search(rb'"code":"([^"]+)"', raw)
        if status >= 400 and m:
            self.codes[m.group(1).decode()] += 1


async def open_conn(port: int, tally: Tally) -> tuple[asyncio.StreamReader,
                                                      asyncio.StreamWriter] | None:
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        tally.refused_at_connect += 1
        return None
    tally.connections += 1
    return r, w


async def read_all(r: asyncio.StreamReader, limit_s: float = 60.0) -> bytes:
    out = b""
    with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
        async with asyncio.timeout(limit_s):
            while chunk := await r.read(65536):
                out += chunk
    return out


async def slow_client(port: int, kind: str, stop: asyncio.Event, tally: Tally) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\n"
    while not stop.is_set():
        conn = await open_conn(port, tally)
        if conn is None:
            await asyncio.sleep(0.5)
            continue
        r, w = conn
        try:
            if kind == "silent":
                raw = await read_all(r)
            else:
                if kind == "body":
                    w.write(head)
                    drip = b'{"messages": "' + b"x" * 2000
                else:
                    drip = head
                reader = asyncio.ensure_future(read_all(r))
                for byte in drip:
                    if reader.done():
                        break
                    w.write(bytes([byte]))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await asyncio.shield(reader)
                raw = await reader
            tally.answer(raw)
            if raw.startswith(b"HTTP/1.1 503"):
                await asyncio.sleep(0.5)  # the cap is full: come back a little later
        except OSError:
            tally.resets += 1
        finally:
            w.close()


def mutated(rng: random.Random) -> tuple[bytes, bytes]:
    """(path, whole request bytes) of one fuzzed request."""
    path = rng.choice([b"/v1/chat/completions", b"/v1/completions"])
    obj: dict[str, object] = {"messages": rng.choice(
        [HI, 5, "hi", {}, [], None, [1], [{"content": "x"}], [{"role": "user", "content": 5}]])}
    for k, vals in (("model", ["qosgate-sim", 7, None, "other"]),
                    ("max_tokens", [4, "4", -1, 10**9, None]),
                    ("stream", [True, False, "yes"]),
                    ("priority", [0, 3, -100, 1.5, "0"]),
                    ("prompt", ["x", [1, 2], [], {}, None]),
                    ("qos_class", ["Realtime", "gold", 3])):
        if rng.random() < 0.5:
            obj[k] = rng.choice(vals)
    body = json.dumps(obj).encode()
    how = rng.randrange(9)
    if how == 1:
        body = body[: rng.randrange(max(1, len(body)))]
    elif how == 2:
        i = rng.randrange(len(body))
        body = body[:i] + bytes(rng.randrange(256) for _ in range(3)) + body[i:]
    elif how == 3:
        body = body[:-1] + b',"pr\\u0069ority":-100}'
    elif how == 4:
        n = rng.randrange(300, 5000)
        body = b'{"messages":' + b"[" * n + b"]" * n + b"}"
    elif how == 5:
        body = body[:-1] + b',"pad":"' + b"p" * (256 << 10) + b'"}'
    elif how == 6:
        body = body[:-1] + b',"x":"\xff\xfe"}'
    headers = [b"Host: gw", b"Connection: close", b"Content-Length: %d" % len(body)]
    if rng.random() < 0.9:
        headers.append(b"Authorization: Bearer sk-abuse")
    if rng.random() < 0.3:
        headers.append(b"x-qos-priority: " + rng.choice([b"0", b"x", b"99999999999999999999"]))
    if rng.random() < 0.3:
        headers.append(b"x-qos-class: " + rng.choice([b"REALTIME", b"batch", b"\xff"]))
    else:
        headers.append(b"Authorization: " + rng.choice([b"Bearer", b"Basic x", b"\x00",
                                                        b"Bearer sk-rt-guess"]))
    return path, b"POST " + path + b" HTTP/1.1\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + body


async def fuzzer(port: int, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        _, data = mutated(rng)
        conn = await open_conn(port, tally)
        if conn is None:
            await asyncio.sleep(0.2)
            continue
        r, w = conn
        try:
            w.write(data)
            tally.answer(await read_all(r))
        except OSError:
            tally.resets += 1
        finally:
            w.close()


async def disconnector(port: int, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    body = json.dumps({"messages": HI, "max_tokens": 200, "stream": True}).encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
           b"Authorization: Bearer sk-abuse\r\nx-qos-priority: 0\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    while not stop.is_set():
        conn = await open_conn(port, tally)
        if conn is None:
            await asyncio.sleep(0.2)
            continue
        r, w = conn
        try:
            w.write(req)
            await w.drain()
            when = rng.choice(["sent", "head", "token"])
            if when != "sent":
                with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError):
                    async with asyncio.timeout(30):
                        got = await r.readuntil(b"\r\n\r\n")
                        if when == "token" and got.startswith(b"HTTP/1.1 200"):
                            await r.readuntil(b"data: ")
        except OSError:
            pass
        finally:
            w.close()
        await asyncio.sleep(0.02)


async def abuse(port: int, seconds: float, slow: int, fuzzers: int, disconnectors: int,
                seed: int, pid: int, samples: list[tuple[int, float]]) -> Tally:
    tally = Tally()
    stop = asyncio.Event()
    kinds = ["silent", "head", "body"]
    tasks = [asyncio.ensure_future(slow_client(port, kinds[i % 3], stop, tally))
             for i in range(slow)]
    tasks += [asyncio.ensure_future(fuzzer(port, seed * 1000 + i, stop, tally))
              for i in range(fuzzers)]
    tasks += [asyncio.ensure_future(disconnector(port, seed * 2000 + i, stop, tally))
              for i in range(disconnectors)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(fds_and_rss(pid))
        await asyncio.sleep(0.5)
    stop.set()
    # every connection still open ends on the gateway's side (its timeouts), not ours
    while not all(t.done() for t in tasks):
        samples.append(fds_and_rss(pid))
        await asyncio.sleep(0.5)
    return tally


# ---------------------------------------------------------------------- report
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=float, default=15.0, help="seconds of realtime alone")
    ap.add_argument("--abuse", type=float, default=40.0, help="seconds of abuse")
    ap.add_argument("--slow", type=int, default=300, help="slow sockets held open")
    ap.add_argument("--fuzzers", type=int, default=6)
    ap.add_argument("--disconnectors", type=int, default=6)
    ap.add_argument("--fd-limit", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="abuse-"))
    port = free_port()
    gw = start_gateway(port, args.fd_limit, workdir)
    try:
        idle = fds_and_rss(gw.pid)
        total0, refused0, ttft0 = scrape(port)
        cpu0, t0 = cpu_s(gw.pid), time.monotonic()
        base = run_realtime(port, args.baseline)
        total1, refused1, ttft1 = scrape(port)
        cpu1, t1 = cpu_s(gw.pid), time.monotonic()

        samples: list[tuple[int, float]] = []
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        rt = ctx.Process(target=realtime_client, args=(port, args.abuse, 0.25, q))
        rt.start()
        time.sleep(1.0)  # the realtime connection is open before the abuse fills the cap
        tally = asyncio.run(abuse(port, args.abuse - 1.0, args.slow, args.fuzzers,
                                  args.disconnectors, args.seed, gw.pid, samples))
        under: list[float] = q.get(timeout=args.abuse + 120)
        rt.join(30)
        cpu2, t2 = cpu_s(gw.pid), time.monotonic()
        time.sleep(1.0)  # outcomes of the last cancellations
        after = fds_and_rss(gw.pid)
        total2, refused2, ttft2 = scrape(port)
        load = os.getloadavg()[0]
        alive = gw.poll() is None
    finally:
        gw.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            gw.wait(30)

    base_ok = [x for x in base if x >= 0]
    under_ok = [x for x in under if x >= 0]
    counted_base = total1 - total0 + sum((refused1 - refused0).values())
    refused = refused2 - refused1
    counted = total2 - total1 + sum(refused.values())
    expected = tally.connections + len(under)
    shed = tally.codes["too_many_connections"]
    fivexx = sum(n for s, n in tally.statuses.items() if s >= 500) - shed
    fivexx += sum(1 for x in base + under if x <= -500)
    peak_fds = max(s[0] for s in samples)
    peak_rss = max(s[1] for s in samples)
    soft_cap = args.fd_limit - 64

    print(f"gateway: simulated engine, descriptor limit {args.fd_limit} (connection cap "
          f"{soft_cap}), header timeout 5 s, body timeout 10 s")
    print(f"abuse: {args.slow} slow sockets, {args.fuzzers} fuzzers, {args.disconnectors} "
          f"disconnectors for {args.abuse:g} s; realtime: 1 streamed request / 250 ms")
    print()
    print(f"{'':36}{'baseline':>14}{'under abuse':>26}")
    failed_base, failed_under = len(base) - len(base_ok), len(under) - len(under_ok)
    print(f"{'realtime requests (ok / failed)':36}{f'{len(base_ok)} / {failed_base}':>14}"
          f"{f'{len(under_ok)} / {failed_under}':>26}")
    print(f"{'realtime TTFT p50':36}{ms(statistics.median(base_ok)):>14}"
          f"{ms(statistics.median(under_ok)) if under_ok else '-':>26}")
    print(f"{'realtime TTFT p90':36}{ms(pct(base_ok, 0.90)):>14}{ms(pct(under_ok, 0.90)):>26}")
    print(f"{'realtime TTFT p99':36}{ms(pct(base_ok, 0.99)):>14}{ms(pct(under_ok, 0.99)):>26}")
    print(f"{'realtime TTFT max':36}{ms(max(base_ok)):>14}{ms(max(under_ok)):>26}")
    print(f"{'  in the gateway, <=25ms/100ms/1s':36}{ttft_share(ttft0, ttft1):>14}"
          f"{ttft_share(ttft1, ttft2):>26}")
    print(f"{'gateway CPU (share of one core)':36}{f'{100 * (cpu1 - cpu0) / (t1 - t0):.0f}%':>14}"
          f"{f'{100 * (cpu2 - cpu1) / (t2 - t1):.0f}%':>26}")
    print(f"{'gateway open descriptors':36}{idle[0]:>14}"
          f"{f'peak {peak_fds}, after {after[0]}':>26}")
    print(f"{'gateway RSS':36}{f'{idle[1]:.0f} MiB':>14}"
          f"{f'peak {peak_rss:.0f}, after {after[1]:.0f} MiB':>26}")
    print()
    print(f"abusive connections: {tally.connections} (refused by the kernel at connect: "
          f"{tally.refused_at_connect}; reset before an answer: {tally.resets})")
    print("  answers: " + ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items())))
    print("  codes:   " + ", ".join(f"{c} {n}" for c, n in tally.codes.most_common()))
    print("  refused before a request (metrics): "
          + ", ".join(f"{r} {n}" for r, n in sorted(refused.items()) if n))
    print(f"5xx other than the connection cap's 503 shedding: {fivexx}   (goal 0)")
    print(f"requests without an outcome: {expected - counted:g}   (goal 0; {expected} sent, "
          f"{counted:g} counted)   baseline: {len(base) - counted_base:g}")
    print(f"gateway still serving after: {'yes' if alive else 'NO'}   (log: {workdir}; load "
          f"average at the end {load:.1f} on {os.cpu_count()} CPUs)")
    if os.environ.get("ABUSE_TRACE"):
        print("under-abuse TTFTs (ms):", [round(x * 1000) for x in under])


if __name__ == "__main__":
    main()
