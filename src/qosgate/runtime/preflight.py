"""Before ``qosgate serve`` says it serves from the embedded engine, prove the engine runs here.

llama.cpp is native code inside the gateway's own process. Built for CPU instructions this machine
cannot execute (a native build that uses AMX or AVX-512, made on another machine, or run where the
OS does not enable them), its first matrix multiply kills the process with a signal -- every
stream in flight, every queued request and the Batch API with it -- and Python can neither catch
it nor log a line. So before the gateway touches llama.cpp itself, a child process builds the very
same replica from the same ``engine`` settings (``runtime/embedded.py``) and runs real decodes:
two prompts prefilled together (matrix x matrix kernels), two sequences decoded together, then
one alone (batch 1 is matrix x vector: llama.cpp may run it on other instructions), and one
embeddings batch when the gateway serves embeddings. If the child dies of a signal, the gateway
exits before it serves, naming the signal, the likely cause and the fix (``WHY``, ``FIX``: one
place for those words); a child that hangs is stopped at the timeout, which says so.

A subprocess of ``sys.executable -m`` (not multiprocessing): its return code names the signal that
killed it, its stderr carries what faulthandler and llama.cpp wrote as it died, and nothing of the
gateway's process is shared or forked. The child reports on stdout in JSON lines: llama.cpp's
system info first (before anything can crash), then ``ok`` or the Python error that stopped it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qosgate.settings import EngineSettings

# -- the words: why the check can die this way, and what to do -----------------------------------

BUILD = "docs/guides/engine.md#building-llamacpp"
FIX = (
    "rebuild llama-cpp-python with the project's portable build: `make clean && make serve`, "
    "or `python3 scripts/llama_env.py install --python .venv/bin/python` (see "
    f"{BUILD})"
)
_INSTRUCTIONS = (
    "llama.cpp (llama-cpp-python) was compiled for CPU instructions this machine cannot run: a "
    "native build (GGML_NATIVE) uses every instruction set of the machine that built it, e.g. "
    "AMX or AVX-512, and faults where one is missing or not enabled by the OS"
)
# per signal: (likely cause, fix); a signal not named here gets ``_OTHER``
WHY: dict[int, tuple[str, str]] = {
    signal.SIGILL: (_INSTRUCTIONS, FIX),
    signal.SIGSEGV: (
        _INSTRUCTIONS + " (an AMX instruction the OS has not enabled faults as a segmentation "
        "fault); less likely, a bug in llama.cpp or a damaged model file", FIX),
    signal.SIGBUS: (
        _INSTRUCTIONS + "; or the model file was changed or truncated while it was mapped", FIX),
    signal.SIGABRT: (
        "llama.cpp stopped itself on a failed check (GGML_ASSERT or GGML_ABORT; its message is "
        "in the output below): a build that does not fit this machine, or a model or settings "
        "it cannot run", FIX + "; if the message names the model or a size, change that"),
    signal.SIGKILL: (
        "it was killed from outside the gateway, most often by the kernel's out-of-memory "
        "killer: the model and its KV cache (n_ctx x max_num_seqs tokens) may not fit in memory",
        "lower --n-ctx or --max-num-seqs, or free memory"),
}
_OTHER = ("a crash in llama.cpp's native code", FIX)
SKIP = ("skip this check: --no-preflight (engine.preflight: false); a crash then comes with the "
        "first request and takes the gateway with it")

# llama.cpp's names of the CPU features it was built for -> the /proc/cpuinfo flag of each
_CPU_FLAG = {
    "SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "AVX_VNNI": "avx_vnni",
    "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
}
# the flags worth printing: instruction sets a llama.cpp build may use (x86 and arm64 names)
_SIMD = re.compile(r"(sse\d\w*|ssse3|pni|avx\w*|amx\w*|fma|f16c|bmi2|asimd\w*|sve\d*|sme\d*|"
                   r"i8mm|bf16)$")
_TAIL_LINES = 25  # of the child's stderr, in the message


# -- the parent's side ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ProbeResult:
    """How the child ended: ``returncode`` None when it was stopped at the timeout."""

    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    timeout_s: float

    def _report(self, key: str) -> Any:
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    doc = json.loads(line)
                    if isinstance(doc, dict) and key in doc:
                        return doc[key]
        return None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self._report("ok") is not None

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def killed_by(self) -> signal.Signals | None:
        """The signal that killed the child, if one did."""
        rc = self.returncode
        if rc is None or rc >= 0:
            return None
        try:
            return signal.Signals(-rc)
        except ValueError:
            return None

    @property
    def error(self) -> str | None:
        """The Python error that stopped the child (a missing model file, a context llama.cpp
        could not create): an ordinary start-up error, not a crash."""
        err = self._report("error")
        return str(err) if err is not None and self.returncode not in (0, None) else None

    @property
    def system_info(self) -> str | None:
        info = self._report("system_info")
        return str(info) if info is not None else None

    @property
    def tokens(self) -> int:
        return int(self._report("ok") or 0)


def run_probe(argv: list[str], timeout_s: float) -> ProbeResult:
    """Run ``argv`` to its end or to ``timeout_s`` (then kill it); what it wrote comes back."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        rc = None
    except BaseException:  # Ctrl+C while it runs: leave no child behind
        proc.kill()
        proc.wait()
        raise
    return ProbeResult(rc, time.monotonic() - start, out, err, timeout_s)


def probe_argv(es: EngineSettings) -> list[str]:
    """The child: this module run by this interpreter, with ``es``."""
    return [sys.executable, "-m", __name__, es.model_dump_json()]


def preflight(es: EngineSettings) -> ProbeResult:
    """Build ``es``'s replica and decode with it in a child process (the module doc)."""
    return run_probe(probe_argv(es), es.preflight_timeout_s)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU's feature flags as the kernel lists them (x86 ``flags``, arm64 ``Features``);
    None where there is no such file."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def built_for(system_info: str) -> list[str]:
    """The CPU features llama.cpp says it was built to use (``AVX2 = 1`` in its system info)."""
    return re.findall(r"\b([A-Z][A-Z0-9_]*) = 1\b", system_info)


def explain(res: ProbeResult, flags: frozenset[str] | None) -> str:
    """What went wrong, for a person: the first line says what happened, then the cause, what
    the CPU and llama.cpp say, the fix and the child's last output. ``""`` when it went well; a
    child's own Python error is ``res.error`` (an ordinary start-up error)."""
    if res.ok:
        return ""
    lines: list[str] = []
    fix: str | None = None
    sig = res.killed_by
    what = ("a child process that loaded the model with the gateway's engine settings and "
            "decoded a few tokens")
    if res.timed_out:
        lines += [
            "qosgate: the embedded engine's start-up check did not finish within "
            f"{res.timeout_s:g} s (engine.preflight_timeout_s), so the gateway does not start.",
            f"  what: {what} was still running; it was stopped.",
            "  likely cause: the machine is too slow or too busy for this model (a large GGUF "
            "read from a slow disk), or llama.cpp hangs here.",
            "  fix: raise engine.preflight_timeout_s in the config; if it never finishes, "
            + FIX,
        ]
    elif sig is not None:
        cause, fix = WHY.get(sig, _OTHER)
        lines += [
            "qosgate: the embedded engine crashed in its start-up check, so the gateway does "
            "not start.",
            f"  what: {what} was killed by {sig.name} ({signal.strsignal(sig) or sig.name}) "
            f"after {res.seconds:.1f} s; inside the gateway the same crash would have killed "
            "the gateway and every request in it.",
            f"  likely cause: {cause}.",
        ]
    else:
        lines += [
            "qosgate: the embedded engine's start-up check failed, so the gateway does not "
            "start.",
            f"  what: {what} exited with status {res.returncode}"
            + (f": {res.error}" if res.error else "") + ".",
        ]
    if flags is not None:
        shown = sorted(f for f in flags if _SIMD.match(f))
        lines.append(f"  this CPU (/proc/cpuinfo): {' '.join(shown) or 'no SIMD flags listed'}")
    info = res.system_info
    if info is None:
        lines.append("  llama.cpp: it died before it could say what it was built for")
    else:
        lines.append(f"  llama.cpp (its system info): {info}")
        if flags is not None:
            absent = [f for f in built_for(info) if f in _CPU_FLAG and _CPU_FLAG[f] not in flags]
            if absent:
                lines.append(f"  llama.cpp was built to use {', '.join(absent)}, which this CPU "
                             "does not list")
    if fix is not None:
        lines.append(f"  fix: {fix}")
    lines.append(f"  {SKIP}")
    tail = res.stderr.strip().splitlines()[-_TAIL_LINES:]
    if tail:
        lines.append("  the check's last output (stderr):")
        lines += [f"    {ln}" for ln in tail]
    return "\n".join(lines)


# -- the child's side ----------------------------------------------------------------------------

_PROMPTS = (("Say hello.", 2), ("Count to three.", 5))  # (message, max_tokens)


def _emit(**doc: Any) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()  # before anything that may crash


def main(argv: list[str] | None = None) -> int:
    """The child (``probe_argv``): exit 0 after the decodes, 1 on a Python error (reported);
    a native crash ends it by a signal, which is the point, and faulthandler leaves the Python
    stack on stderr first."""
    faulthandler.enable()
    args = sys.argv[1:] if argv is None else argv
    try:
        es = EngineSettings.model_validate_json(args[0])
        # the embedded extra's side (jinja2, llama_cpp): the gateway's side of this module,
        # and its tests, do without it
        from qosgate.models.llamacpp import system_info
        from qosgate.models.step import Sampling, SeqSpec
        from qosgate.runtime.embedded import llamacpp_from_settings

        _emit(system_info=system_info())
        replica = llamacpp_from_settings(es)
        engine = replica.engine
        tokens = 0
        try:
            for i, (text, cap) in enumerate(_PROMPTS):
                engine.add(SeqSpec(f"preflight-{i}", 1, cap,
                                   messages=[{"role": "user", "content": text}],
                                   sampling=Sampling(temperature=0.0)))
            while engine.has_work():
                tokens += len(engine.step().tokens)
            if replica.embedder is not None:
                replica.embedder.embed(["Say hello."])
        finally:
            close = getattr(engine, "close", None)
            if callable(close):
                close()
            if replica.embedder is not None:
                replica.embedder.close()
    except Exception as exc:  # reported to the parent, which says it as a start-up error
        _emit(error=str(exc) or type(exc).__name__)
        return 1
    _emit(ok=tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
