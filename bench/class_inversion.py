"""Tag only the batch job: an offline flood tagged ``x-qos-class: offline`` and, beside it,
untagged short requests (class ``api``), through real processes on the gateway's defaults.

    .venv/bin/python bench/class_inversion.py [--seconds 60] [--flood 48] [--seed 1]
        [--time-scale 4] [--offline-tokens 64 128] [--config FILE] [--json]

A benchmark, not a test: it prints what happened. One vLLM stand-in (the default profile,
``--scheduling-policy priority``, a batch of 16, every step ``--time-scale`` times as long: 4 by
default, so that two cores keep it saturated) behind ``qosgate serve --upstream URL`` with
nothing else set.
Two phases, each on fresh processes and for ``--seconds``:

1. **api beside offline**: ``--flood`` offline streams, closed loop (each sends the next as soon
   as its last ends: a backlog in the gateway at all times), and untagged api requests at
   ``API_RATE`` per second, open loop;
2. **+ realtime**: the same, and realtime-tagged requests at ``RT_RATE`` per second.

Printed per phase: api sent / served / refused (by code, with the ``Retry-After`` values) / timed
out, api TTFT p50/p90 (first event of the stream, from the client's send), how many offline
requests that were sent *after* an api request got their first byte *before* it (summed over the
api requests), how many offline requests got their first byte while an api request waited (the
mean over api requests: under 5:3:2 shares in cost, with offline's requests several times api's,
about none), realtime TTFT p50/p90/p99, and the offline output
tokens per second (from each stream's usage chunk) over the phase.

To compare with another version of qosgate, run this file with that version importable first
(``PYTHONPATH=/path/to/other/src``): the gateway runs as ``python -m qosgate.cli``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

import uvloop  # noqa: E402

from bench.fleet_faults import MODEL, Rec, _Resp, pct  # noqa: E402
from tests.support.processes import start_gateway, start_standin  # noqa: E402

API_RATE = 2.0  # untagged requests per second
RT_RATE = 1.0  # realtime requests per second (phase 2)
API_TOKENS, RT_TOKENS = (16, 32), (16, 48)
DRAIN_S = 30.0  # after the phase, how long the api and realtime requests may still take
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


class _Watched(_Resp):
    """The bench's response parser, also keeping ``Retry-After`` and the usage chunk."""

    def __init__(self, rec: Rec, done: asyncio.Future[None]) -> None:
        super().__init__(rec, done)
        self.retry_after: str | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"retry-after":
            self.retry_after = value.decode()


async def send(port: int, rec: Rec, tagged: bool) -> tuple[Rec, str | None, int]:
    """One streamed chat request; (its record, Retry-After, output tokens from the usage)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    proto = _Watched(rec, done)
    rec.sent = time.monotonic()
    try:
        transport, _ = await loop.create_connection(lambda: proto, "127.0.0.1", port)
    except OSError as exc:
        rec.outcome, rec.end = f"transport:{type(exc).__name__}", time.monotonic()
        return rec, None, 0
    body = json.dumps({
        "model": MODEL, "stream": True, "max_tokens": rec.max_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"bench-{rec.i} " + "x" * rec.prompt_chars}],
    }).encode()
    tag = f"x-qos-class: {rec.cls}\r\n" if tagged else ""
    transport.write((
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\n{tag}Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    await done
    m = _USAGE.search(proto.tail)
    return rec, proto.retry_after, int(m.group(1)) if m else 0


async def phase(port: int, seconds: float, flood: int, realtime: bool, seed: int,
                offline_tokens: tuple[int, int]) -> dict[str, object]:
    rng = random.Random(seed)
    ids = iter(range(1, 10**9))
    results: list[tuple[Rec, str | None, int]] = []
    stop_at = time.monotonic() + seconds
    t0 = time.monotonic()

    async def offline_loop() -> None:
        while time.monotonic() < stop_at:
            rec = Rec(next(ids), "offline", rng.randint(*offline_tokens), rng.randint(400, 1200))
            results.append(await send(port, rec, tagged=True))

    async def open_loop(cls: str, rate: float, tokens: tuple[int, int], tagged: bool) -> None:
        tasks = []
        at = time.monotonic()
        while at < stop_at:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            rec = Rec(next(ids), cls, rng.randint(*tokens), rng.randint(100, 300))
            tasks.append(asyncio.ensure_future(send(port, rec, tagged)))
            at += rng.expovariate(rate)
        results.extend(await asyncio.wait_for(asyncio.gather(*tasks), seconds + DRAIN_S))

    floods = [asyncio.ensure_future(offline_loop()) for _ in range(flood)]
    loops = [open_loop("api", API_RATE, API_TOKENS, tagged=False)]
    if realtime:
        loops.append(open_loop("realtime", RT_RATE, RT_TOKENS, tagged=True))
    await asyncio.gather(*loops)
    span = time.monotonic() - t0
    for f in floods:
        f.cancel()  # offline streams still open are abandoned (the client disconnects)
    await asyncio.gather(*floods, return_exceptions=True)

    def ttft(cls: str) -> list[float]:
        return [r.first - r.sent for r, _, _ in results
                if r.cls == cls and r.first is not None and r.outcome == "completed"]

    api = [(r, ra) for r, ra, _ in results if r.cls == "api"]
    offline = [r for r, _, _ in results if r.cls == "offline"]
    overtaken = during = 0
    firsts = sorted((r.sent, r.first) for r in offline if r.first is not None)
    for r, _ in api:
        done_at = r.first if r.first is not None else r.end or r.sent
        overtaken += sum(1 for sent, first in firsts if sent > r.sent and first < done_at)
        during += sum(1 for _, first in firsts if r.sent < first < done_at)
    refused = Counter(r.outcome for r, _ in api if r.outcome.startswith("http_"))
    retry = Counter(ra for r, ra in api if r.outcome.startswith("http_") and ra is not None)
    return {
        "api_sent": len(api),
        "api_served": sum(1 for r, _ in api if r.outcome == "completed"),
        "api_refused": dict(refused),
        "api_retry_after_s": dict(retry),
        "api_timed_out": sum(1 for r, _ in api if "timeout" in r.outcome),
        "api_other": dict(Counter(r.outcome for r, _ in api if r.outcome != "completed"
                                  and not r.outcome.startswith("http_"))),
        "api_ttft_s": [pct(ttft("api"), 50), pct(ttft("api"), 90)],
        "offline_sent_after_api_first_before_it": overtaken,
        "offline_answered_while_api_waited": during / len(api) if api else 0.0,
        "realtime_ttft_s": [pct(ttft("realtime"), q) for q in (50, 90, 99)] if realtime else None,
        "realtime_served": sum(1 for r, _, _ in results
                               if r.cls == "realtime" and r.outcome == "completed"),
        "realtime_sent": sum(1 for r, _, _ in results if r.cls == "realtime"),
        "realtime_not_served": dict(Counter(r.outcome for r, _, _ in results
                                            if r.cls == "realtime" and r.outcome != "completed")),
        "offline_completed": sum(1 for r in offline if r.outcome == "completed"),
        "offline_tokens_per_s": sum(n for r, _, n in results if r.cls == "offline") / span,
    }


def _ms(xs: object) -> str:
    if not isinstance(xs, list):
        return "-"
    return " / ".join("-" if x is None else f"{1000 * x:.0f}" for x in xs)


async def main(args: argparse.Namespace) -> None:
    import qosgate

    print(f"qosgate from {Path(qosgate.__file__).parent}")
    for realtime in (False, True):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            si = start_standin(tmp, "--scheduling-policy", "priority", "--max-num-seqs", "16",
                               "--time-scale", str(args.time_scale))
            gw = start_gateway(tmp, "--upstream", si.url,
                               *(["--config", args.config] if args.config else []))
            try:
                res = await phase(gw.port, args.seconds, args.flood, realtime, args.seed,
                                  (args.offline_tokens[0], args.offline_tokens[1]))
            finally:
                gw.stop()
                si.stop()
        name = "api beside offline" + (" + realtime" if realtime else "")
        print(f"\n{name} ({args.seconds:.0f} s, {args.flood} offline streams of "
              f"{args.offline_tokens[0]}-{args.offline_tokens[1]} tokens, engine steps "
              f"x{args.time_scale:g}, api "
              f"{API_RATE}/s untagged" + (f", realtime {RT_RATE}/s" if realtime else "") + ")")
        print(f"  api: sent {res['api_sent']}, served {res['api_served']}, refused "
              f"{res['api_refused'] or 0} (Retry-After s: {res['api_retry_after_s'] or '-'}), "
              f"timed out {res['api_timed_out']}, other {res['api_other'] or 0}")
        print(f"  api TTFT p50 / p90: {_ms(res['api_ttft_s'])} ms")
        print(f"  offline requests sent after an api request and answered before it "
              f"(summed over api): {res['offline_sent_after_api_first_before_it']}; "
              f"offline answered while an api request waited (mean per api request): "
              f"{res['offline_answered_while_api_waited']:.1f}")
        if realtime:
            print(f"  realtime: served {res['realtime_served']} of {res['realtime_sent']} "
                  f"(not: {res['realtime_not_served'] or 0}), "
                  f"TTFT p50 / p90 / p99: {_ms(res['realtime_ttft_s'])} ms")
        print(f"  offline: {res['offline_completed']} completed, "
              f"{res['offline_tokens_per_s']:.1f} output tokens/s")
        if args.json:
            print("  json: " + json.dumps(res))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--flood", type=int, default=48, help="offline streams, closed loop")
    ap.add_argument("--time-scale", type=float, default=4.0,
                    help="the stand-in's step duration factor (8: a slower engine)")
    ap.add_argument("--offline-tokens", type=int, nargs=2, default=(64, 128),
                    metavar=("MIN", "MAX"), help="offline output lengths")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="also print each phase as JSON")
    ap.add_argument("--config", help="a qosgate config file for the gateway (default: none)")
    uvloop.run(main(ap.parse_args()))
