"""Several real gateway processes sharing tenant state through a real redis-server.

A limit of R requests/min over 4 instances admits R (plus what refills meanwhile), not 4R; a
concurrency cap holds across instances; kill -9 of an instance frees its leases within the TTL;
Redis killed mid-run: nothing lost, the degraded gauge rises, limits fall to each instance's
share, and Redis back re-syncs; fairness across instances under a flood.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

ADMIN = {"Authorization": "Bearer sk-admin"}


def config(path: Path, standin: str, capacity: int = 16, lease_ttl: float = 1.0) -> Path:
    path.write_text(f"""
tenants:
  - {{name: rated, api_keys: [sk-rated], limits: {{requests_per_minute: 40}}}}
  - {{name: capped, api_keys: [sk-capped], limits: {{max_concurrent: 3}}}}
  - {{name: pair, api_keys: [sk-pair], limits: {{max_concurrent: 2}}}}
  - {{name: t0, api_keys: [sk-t0]}}
  - {{name: t1, api_keys: [sk-t1]}}
  - {{name: t2, api_keys: [sk-t2]}}
  - {{name: t3, api_keys: [sk-t3]}}
server: {{admin_keys: [sk-admin]}}
redis: {{lease_ttl_s: {lease_ttl}}}
upstreams:
  - url: {standin}
    max_window: {capacity}
""")
    return path


def post(gw: Server, key: str, max_tokens: int = 2, timeout: float = 30) -> int:
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    status, _, _ = http("POST", gw.url + "/v1/chat/completions", body,
                        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                        timeout=timeout)
    return status


def post_admitted(gw: Server, key: str, max_tokens: int, timeout: float = 60) -> int:
    """Retry while refused with 429 (an instance leases a slot once it sees the demand)."""
    deadline = time.monotonic() + 30
    while True:
        code = post(gw, key, max_tokens, timeout)
        if code != 429 or time.monotonic() > deadline:
            return code
        time.sleep(0.02)  # a client's back-off


def status(gw: Server) -> dict[str, Any]:
    _, _, body = http("GET", gw.url + "/v1/qos/status", headers=ADMIN)
    out: dict[str, Any] = json.loads(body)
    return out


def gauge(gw: Server, name: str) -> float:
    _, _, text = http("GET", gw.url + "/metrics", headers=ADMIN)
    values = metric_values(text.decode(), name)
    return sum(values.values())


def holding(gw: Server, tenant: str) -> int:
    t = status(gw)["tenants"].get(tenant, {})
    return int(t.get("queued", 0)) + int(t.get("inflight", 0))


class Fleet:
    """n gateways in front of one stand-in, sharing state through a redis-server (``redis``
    False: started without --redis, each instance its own limits and fair-share counters)."""

    def __init__(self, tmp: Path, n: int, capacity: int = 16, lease_ttl: float = 1.0,
                 standin_args: tuple[str, ...] = (), redis: bool = True) -> None:
        self.redis = RedisServer(tmp) if redis else None
        self.standin = start_standin(tmp, *standin_args)
        cfg = config(tmp / "fleet.yaml", self.standin.url, capacity, lease_ttl)
        self.gws: list[Server] = []
        for i in range(n):
            shared = ("--redis", self.redis.url) if self.redis is not None else ()
            self.gws.append(start_gateway(tmp, "--config", str(cfg), *shared,
                                          "--instance-id", f"gw{i}"))
        if self.redis is not None:
            assert wait_until(lambda: all(status(g)["shared_state"]["live_instances"] == n
                                          for g in self.gws), timeout=10)

    def close(self) -> None:
        for g in self.gws:
            g.stop()
        self.standin.stop()
        if self.redis is not None:
            self.redis.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("fleet4"), 4, capacity=2)
    yield f
    f.close()


def test_each_instance_says_who_answered(fleet: Fleet) -> None:
    for i, g in enumerate(fleet.gws):
        st = status(g)
        assert st["instance"] == f"gw{i}"
        assert st["shared_state"]["store"] == "redis"
        assert sorted(st["shared_state"]["fleet"]) == ["gw0", "gw1", "gw2", "gw3"]
        _, _, text = http("GET", g.url + "/metrics", headers=ADMIN)
        info = metric_values(text.decode(), "qosgate_instance_info")
        assert info == {(("instance", f"gw{i}"), ("shared_state", "redis")): 1.0}


def test_a_rate_limit_over_4_instances_admits_r_not_4r(fleet: Fleet) -> None:
    r = 40
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: post(fleet.gws[i % 4], "sk-rated"), range(4 * r)))
    elapsed = time.monotonic() - t0
    admitted = codes.count(200)
    refill = r * elapsed / 60
    # a lease is spent once; the documented overshoot (docs/guides/several-instances.md) is what the
    # instances held leased while the bucket refilled to full when idle: max(1, R/60/live) each,
    # here 1 per instance; and up to one per instance may still be leased, unspent, at the end
    assert set(codes) <= {200, 429}, Counter(codes)
    assert r - 4 <= admitted <= r + refill + 4, (admitted, elapsed)
    assert admitted < 2 * r


def test_a_concurrency_cap_holds_across_instances(fleet: Fleet) -> None:
    cap = 3
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, sum(holding(g, "capped") for g in fleet.gws))

    w = threading.Thread(target=watch)
    w.start()
    try:
        with ThreadPoolExecutor(12) as pool:  # 12 clients, each retrying while refused
            codes = list(pool.map(lambda i: post_admitted(fleet.gws[i % 4], "sk-capped", 40),
                                  range(12)))
    finally:
        stop.set()
        w.join()
    assert codes == [200] * 12, Counter(codes)
    assert 1 <= peak <= cap, peak


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def test_fairness_across_instances_under_a_flood(fleet: Fleet) -> None:
    """4 equal-weight tenants, each with 5 clients whose requests go to every instance in turn,
    far more than the fleet's 8 slots: what each tenant gets completed is even (Jain >= 0.95)."""
    done: Counter[str] = Counter()
    end = time.monotonic() + 4.0
    lock = threading.Lock()

    def client(tenant: int, j: int) -> None:
        i = j
        while time.monotonic() < end:
            code = post(fleet.gws[i % 4], f"sk-t{tenant}", 6)
            i += 1
            if code == 200:
                with lock:
                    done[f"t{tenant}"] += 1

    threads = [threading.Thread(target=client, args=(t, j)) for t in range(4) for j in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [float(done[f"t{t}"]) for t in range(4)]
    assert sum(counts) > 20, counts
    assert jain(counts) >= 0.95, counts


# tenant -> the instances its clients reach: t0 only 0-1, t1 all four, t2 only 2-3, t3 only 3
SKEWED = {0: (0, 1), 1: (0, 1, 2, 3), 2: (2, 3), 3: (3,)}


def skewed_flood(fleet: Fleet, seconds: float = 5.0, per_instance: int = 6) -> list[float]:
    """Each of the 4 equal-weight tenants has ``per_instance`` closed-loop clients at every
    instance it reaches (SKEWED): each instance has 2 slots, so every tenant is backlogged at
    every instance it reaches; what each got completed. Each instance alone splits its slots
    between the tenants it sees: t1 (everywhere) gets ~3.7 slots of 8, t3 (one instance) ~0.7."""
    done: Counter[int] = Counter()
    end = time.monotonic() + seconds
    lock = threading.Lock()

    def client(tenant: int, gw: Server) -> None:
        while time.monotonic() < end:
            code = post(gw, f"sk-t{tenant}", 6)
            if code == 200:
                with lock:
                    done[tenant] += 1

    threads = [threading.Thread(target=client, args=(t, fleet.gws[i]))
               for t, reach in SKEWED.items() for i in reach for _ in range(per_instance)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [float(done[t]) for t in range(4)]


def test_fairness_when_tenants_reach_different_instances(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tenants reaching different subsets of the instances, flooded: close to even completed
    work with the fair-share counters shared through Redis, clearly not without them (the same
    4 instances started without --redis). Jain >= 0.9 here, not the 0.95 of the even spread:
    closed-loop clients on a shared machine make a skewed flood noisier. Before VTC's lifts
    were kept out of the synced counters, runs of this file after its other tests starved one
    tenant (Jain 0.27-0.78); since, 0.968-0.997 (docs/guides/several-instances.md)."""
    shared = skewed_flood(fleet)
    alone = Fleet(tmp_path, 4, capacity=2, redis=False)
    try:
        own = skewed_flood(alone)
    finally:
        alone.close()
    with capsys.disabled():
        print(f"\nskewed flood, completed per tenant t0..t3: redis {shared} "
              f"(Jain {jain(shared):.3f}); without {own} (Jain {jain(own):.3f})")
    assert sum(shared) > 40 and sum(own) > 40, (shared, own)
    assert jain(shared) >= 0.9, shared
    assert jain(own) <= jain(shared) - 0.1, (shared, own)


def test_kill_9_of_an_instance_frees_its_leases_within_the_ttl(tmp_path: Path) -> None:
    ttl = 1.0
    f = Fleet(tmp_path, 2, lease_ttl=ttl, standin_args=("--time-scale", "4"))
    a, b = f.gws
    pool = ThreadPoolExecutor(2)
    try:
        # a holds both of pair's slots with long requests
        for _ in range(2):
            pool.submit(post_admitted, a, "sk-pair", 2000)
        assert wait_until(lambda: holding(a, "pair") == 2, timeout=10)
        assert post(b, "sk-pair") == 429  # the cap holds across instances
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        killed = time.monotonic()
        assert wait_until(lambda: post(b, "sk-pair") == 200, timeout=ttl + 3, every=0.05)
        freed = time.monotonic() - killed
        # the TTL, then one sync (and the retry's own round trip)
        assert freed <= ttl + 1.0, freed
        assert wait_until(lambda: status(b)["shared_state"]["live_instances"] == 1,
                          timeout=ttl + 2)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        f.close()


def test_redis_killed_mid_run_degrades_to_each_share_then_resyncs(tmp_path: Path) -> None:
    f = Fleet(tmp_path, 2)
    a = f.gws[0]
    codes: list[int] = []
    stop = threading.Event()

    def steady() -> None:  # an unlimited tenant's steady traffic across the outage
        i = 0
        while not stop.is_set():
            codes.append(post(f.gws[i % 2], "sk-t0"))
            i += 1

    t = threading.Thread(target=steady)
    t.start()
    try:
        assert wait_until(lambda: len(codes) >= 10, timeout=10)
        assert gauge(a, "qosgate_shared_state_degraded") == 0
        f.redis.kill()
        assert wait_until(lambda: all(gauge(g, "qosgate_shared_state_degraded") == 1
                                      for g in f.gws), timeout=5)
        # each instance now admits at most its share: 40 / 2 live instances (plus the refill)
        t0 = time.monotonic()
        burst = [post(a, "sk-rated") for _ in range(40)]
        refill = 20 * (time.monotonic() - t0) / 60
        assert set(burst) <= {200, 429}
        assert 19 <= burst.count(200) <= 20 + refill + 1, burst.count(200)
        log = a.log.read_text()
        assert log.count("shared state unreachable") == 1, log
        # Redis back on the same port (empty): re-synced, the fleet seen again
        f.redis.start()
        assert wait_until(lambda: all(gauge(g, "qosgate_shared_state_degraded") == 0
                                      for g in f.gws), timeout=10)
        assert wait_until(lambda: status(a)["shared_state"]["live_instances"] == 2, timeout=5)
        assert "re-synced" in a.log.read_text()
        n = len(codes)
        assert wait_until(lambda: len(codes) >= n + 10, timeout=10)
    finally:
        stop.set()
        t.join()
        f.close()
    assert codes and set(codes) == {200}, Counter(codes)


def test_workers_share_one_port_each_an_instance(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    standin = start_standin(tmp_path)
    cfg = config(tmp_path / "workers.yaml", standin.url)
    gw = start_gateway(tmp_path, "--config", str(cfg), "--redis", redis.url, "--workers", "2",
                       "--instance-id", "host")
    try:
        seen: set[str] = set()

        def both() -> bool:  # each request a new connection: the kernel spreads them
            st = status(gw)
            seen.add(st["instance"])
            return seen == {"host-w0", "host-w1"} and st["shared_state"]["live_instances"] == 2

        assert wait_until(both, timeout=15), seen
        assert post(gw, "sk-t0") == 200
    finally:
        assert gw.stop() == 0
        standin.stop()
        redis.stop()
