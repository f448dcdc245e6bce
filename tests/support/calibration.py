"""What the calibration tests probe and check, in virtual time (``tests/calibrate``) and against
a live stand-in (``tests/e2e/test_calibrate.py``)."""

from __future__ import annotations

PROFILE = "llama-3-8b-a100"  # large per-token and per-seq costs: every coefficient shows
COEFS = ("step_fixed_s", "prefill_s_per_token", "prefill_s_per_ctx_token",
         "decode_s_per_ctx_token", "decode_s_per_seq")
