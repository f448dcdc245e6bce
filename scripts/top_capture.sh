#!/usr/bin/env bash
# The captures in docs/guides/top.md (docs/img/top-*.txt): two vLLM stand-ins, one gateway and two workers
# sharing Redis under a mixed load, `qosgate top` in a 160x45 tmux pane, engine-b switched to 503.
# Run from anywhere with the venv installed (make test or make serve did it); takes about 40 s.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/topdemo
cat > /tmp/topdemo/gw.yaml <<'EOF'
tenants:
  - {name: alice, api_keys: [sk-alice]}
  - {name: bob, api_keys: [sk-bob], limits: {max_concurrent: 2}}
server: {admin_keys: [sk-admin], metrics_auth: true}
upstreams:
  - {url: "http://127.0.0.1:8101", name: engine-a, capacity: 4, priority_polarity: vllm}
  - {url: "http://127.0.0.1:8102", name: engine-b, capacity: 4, priority_polarity: vllm}
EOF
cat > /tmp/topdemo/load.py <<'EOF'
"""Mixed load for 90 s: alice's realtime, api and offline streams, bob's batch (capped at 2)."""
import sys, threading, time
from openai import OpenAI, APIStatusError

url, end = sys.argv[1], time.monotonic() + 90
def worker(key: str, cls: str, max_tokens: int) -> None:
    c = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    while time.monotonic() < end:
        try:
            for _ in c.chat.completions.create(
                    model="Qwen/Qwen2.5-7B-Instruct", max_tokens=max_tokens, stream=True,
                    messages=[{"role": "user", "content": "hello"}],
                    extra_headers={"x-qos-class": cls}):
                pass
        except APIStatusError:
            time.sleep(0.5)  # refused: back off
plan = ([("sk-alice", "realtime", 20)] * 2 + [("sk-alice", "api", 80)] * 3
        + [("sk-alice", "offline", 400)] * 6 + [("sk-bob", "batch", 200)] * 4)
for args in plan:
    threading.Thread(target=worker, args=args).start()
EOF
# two vLLM stand-ins (simulated engines, not vLLM), one gateway, and two workers sharing Redis
.venv/bin/python -m qosgate.standin --port 8101 --scheduling-policy priority \
    > /tmp/topdemo/a.log 2>&1 &
.venv/bin/python -m qosgate.standin --port 8102 --scheduling-policy priority \
    > /tmp/topdemo/b.log 2>&1 &
redis-server --port 6391 --bind 127.0.0.1 --save '' --appendonly no > /tmp/topdemo/redis.log 2>&1 &
sleep 3
.venv/bin/qosgate serve --config /tmp/topdemo/gw.yaml --port 8100 > /tmp/topdemo/gw.log 2>&1 &
.venv/bin/qosgate serve --config /tmp/topdemo/gw.yaml --port 8300 --workers 2 \
    --redis redis://127.0.0.1:6391/0 --instance-id gw2 > /tmp/topdemo/gw2.log 2>&1 &
sleep 8
.venv/bin/python /tmp/topdemo/load.py http://127.0.0.1:8100 > /tmp/topdemo/load.log 2>&1 &
.venv/bin/python /tmp/topdemo/load.py http://127.0.0.1:8300 > /tmp/topdemo/load2.log 2>&1 &
tmux new-session -d -s top -x 160 -y 45 \
    'QOSGATE_ADMIN_KEY=sk-admin .venv/bin/qosgate top http://127.0.0.1:8100 http://127.0.0.1:8300'
sleep 20
# engine-b starts answering 503 with Retry-After: 3 (the stand-in's fault switch)
curl -s -X POST http://127.0.0.1:8102/admin/fault -H 'Content-Type: application/json' \
    -d '{"fault": "503", "retry_after": 3}'; echo
sleep 4
tmux capture-pane -p -t top > docs/img/top-live.txt
QOSGATE_ADMIN_KEY=sk-admin .venv/bin/qosgate top http://127.0.0.1:8100 --once \
    > docs/img/top-once.txt; echo "exit $?"
.venv/bin/qosgate top http://127.0.0.1:8100 http://127.0.0.1:8109 --once --key sk-wrong \
    > docs/img/top-unreachable.txt 2>&1; echo "exit $?"
tmux kill-session -t top
kill $(jobs -p)
