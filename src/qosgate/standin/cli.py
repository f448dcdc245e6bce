"""``python -m qosgate.standin``: the stand-in's command line (see ``standin/server.py``)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from qosgate.standin.faults import Fault, FaultError, Listener, parse_fault
from qosgate.standin.lora import LoraAdapters, parse_modules
from qosgate.standin.server import StandIn


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m qosgate.standin",
        description="OpenAI-compatible stand-in for vLLM (simulated GPU engine; not vLLM).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="as vLLM: 'priority' handles a smaller priority value first")
    p.add_argument("--profile", default="default", help="simulated engine profile (name or path)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every modelled step duration (0.1 = ten times faster)")
    p.add_argument("--served-model-name", default=None, help="model id (default: the profile's)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="as vLLM's generation-config max_new_tokens: the cap of a request that "
                   "sets none (default: the rest of the context, as vLLM's)")
    p.add_argument("--eos-after", type=int, default=256,
                   help="the filler model's answer length when a request sets no cap (its EOS)")
    p.add_argument("--max-model-len", type=int, default=32768,
                   help="as vLLM's: a larger max_tokens is a 400 (default: Qwen2.5-7B's 32768)")
    p.add_argument("--record", default=None, help="append every request body here (JSON lines)")
    p.add_argument("--fault", action="append", default=[], type=_fault_arg, metavar="SPEC",
                   help="switch a fault on at start (repeatable): die[:after=S], refuse[:for=S], "
                   "hang-first-byte, hang-mid-stream[:after=N], slow:factor=F, "
                   "429|503[:retry-after=S], 500; options for=S, at=S, count=N "
                   "(see qosgate.standin.faults)")
    p.add_argument("--slow", type=float, default=None, metavar="FACTOR",
                   help="every engine step takes FACTOR times as long (the fault slow:factor=F)")
    p.add_argument("--embed-overhead-ms", type=float, default=20.0,
                   help="/v1/embeddings: fixed cost of one call (a batch)")
    p.add_argument("--embed-token-us", type=float, default=50.0,
                   help="/v1/embeddings: cost per input token (characters / 4)")
    p.add_argument("--embed-dim", type=int, default=384)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="as vLLM (on by default): a prompt's cached leading blocks "
                   "are not computed again (--no-enable-prefix-caching: off)")
    p.add_argument("--block-size", type=int, default=16,
                   help="as vLLM: tokens per KV block, the prefix cache's unit")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="as vLLM: each usage reports prompt_tokens_details.cached_tokens")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="as vLLM: a host (CPU DRAM) KV cache of this many GiB beside the GPU's "
                   "(unset: none)")
    p.add_argument("--kv-offloading-backend", choices=["native"], default="native",
                   help="as vLLM; only its native CPU offloading is modelled")
    p.add_argument("--enable-lora", action="store_true", help="as vLLM: serve LoRA adapters")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="as vLLM: the adapters registered at start")
    p.add_argument("--max-loras", type=int, default=1,
                   help="as vLLM: adapters loaded at once (least recently used evicted)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="as vLLM (not checked)")
    p.add_argument("--lora-load-ms", type=float, default=20.0,
                   help="the modelled time to load an adapter that is not loaded")
    p.add_argument("--log-level", default="warning")
    return p


def _fault_arg(spec: str) -> Fault:
    try:
        return parse_fault(spec)
    except FaultError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    faults: list[Fault] = list(args.fault)
    if args.slow is not None:
        if args.slow <= 0:
            build_parser().error("--slow must be > 0")
        faults.append(Fault("slow", factor=args.slow))
    try:
        app = StandIn(
            profile=args.profile,
            policy=args.scheduling_policy,
            time_scale=args.time_scale,
            served_model_name=args.served_model_name,
            max_num_seqs=args.max_num_seqs,
            default_max_tokens=args.default_max_tokens,
            eos_after=args.eos_after,
            record=args.record,
            max_model_len=args.max_model_len,
            faults=faults,
            embed_overhead_ms=args.embed_overhead_ms,
            embed_token_us=args.embed_token_us,
            embed_dim=args.embed_dim,
            prefix_caching=args.enable_prefix_caching,
            block_size=args.block_size,
            prompt_tokens_details=args.enable_prompt_tokens_details,
            kv_offloading_size=args.kv_offloading_size,
            lora=LoraAdapters(parse_modules(args.lora_modules), args.max_loras,
                              args.lora_load_ms / 1000.0) if args.enable_lora else None,
            runtime_lora_updating=os.environ.get(
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        )
    except ValueError as exc:  # a profile or size the stand-in cannot use
        build_parser().error(str(exc))
    kwargs: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        kwargs["loop"] = "uvloop"
    except ImportError:  # pragma: no cover
        kwargs["loop"] = "asyncio"
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http="httptools",
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        backlog=4096,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        **kwargs,
    )
    server = uvicorn.Server(config)
    app.listener = Listener(server)  # what the ``refuse`` fault stops and restarts
    server.run()

