"""How close ``qosgate calibrate`` comes to a live engine's true profile, timing noise included.

    .venv/bin/python bench/calibrate_accuracy.py [--profile llama-3-8b-a100] [--runs 3]
        [--time-limit 60] [--time-scale 1]

A benchmark, not a test: the stand-in serves a built-in profile in real time (``--time-scale``
slower if asked), so the fitted coefficients carry whatever the machine's load adds to the
token times. The test suite pins the probe and the fit exactly in virtual time
(``tests/calibrate``); this prints, for each of ``--runs`` probes of one live stand-in, each
coefficient's relative error against the profile the stand-in serves, and the worst of them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

from qosgate.models.simmodel import load_profile  # noqa: E402
from tests.support.processes import QOSGATE, start_standin  # noqa: E402

COEFS = ("step_fixed_s", "prefill_s_per_token", "prefill_s_per_ctx_token",
         "decode_s_per_ctx_token", "decode_s_per_seq")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="llama-3-8b-a100")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    args = ap.parse_args()
    true = load_profile(args.profile)
    scale = args.time_scale
    print(f"stand-in serving {args.profile} at time scale {scale:g}; {args.runs} probes of "
          f"at most {args.time_limit:g} s")
    print(f"{'run':>3} " + " ".join(f"{c:>24}" for c in COEFS) + f" {'worst':>7}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        s = start_standin(tmp, "--profile", args.profile, "--time-scale", str(scale))
        try:
            for i in range(args.runs):
                out = tmp / f"fit{i}.yaml"
                subprocess.run([*QOSGATE, "calibrate", s.url, "--out", str(out),
                                "--time-limit", str(args.time_limit), "--seed", str(i),
                                "--max-num-seqs", str(true.max_num_seqs),
                                "--max-num-batched-tokens", str(true.max_num_batched_tokens),
                                "--kv-capacity-tokens", str(true.kv_capacity_tokens)],
                               check=True, stdout=subprocess.DEVNULL)
                fitted = load_profile(out)
                cells, worst = [], 0.0
                for c in COEFS:
                    want = getattr(true, c) * scale
                    got = getattr(fitted, c)
                    if want:
                        err = (got - want) / want
                        worst = max(worst, abs(err))
                        cells.append(f"{got:.4g} ({err:+.1%})")
                    else:
                        cells.append(f"{got:.3g} (true 0)")
                print(f"{i:>3} " + " ".join(f"{c:>24}" for c in cells) + f" {worst:>7.1%}")
        finally:
            s.stop()


if __name__ == "__main__":
    main()
