"""Whether an engine is still making progress, and how long a whole answer may take.

Two rules about an engine seen from outside, both pure (time passed in):

- ``whole_answer_s``: a client that did not ask for a stream gets its first byte only when the
  whole answer is done, so the bound on that first byte is the first token's bound plus the
  time to generate the output it may ask for, at the engine's measured time per token (with a
  margin, since that measure is a recent mean and the request may land on a busier step).
- ``StallWatch``: an engine that accepts requests and never answers them is not down by any
  connection error; it is found by its own progress counter (the output tokens it has
  generated) standing still while it holds work, as SMG's ``--worker-stall-secs`` does.
"""

from __future__ import annotations


def whole_answer_s(first_byte_s: float, output_tokens: int | None, token_s: float | None,
                   *, assumed_token_s: float, margin: float) -> float:
    """The bound on a whole answer's arrival: ``first_byte_s`` (the class's bound on the first
    token) plus ``output_tokens`` at ``margin`` times the engine's time per output token
    (``token_s``, measured; ``assumed_token_s`` until a measurement exists). With no output
    bound known (no cap asked, no context length known), only the first-byte bound: the call's
    total bound still holds."""
    if output_tokens is None:
        return first_byte_s
    per_token = token_s if token_s is not None else assumed_token_s
    return first_byte_s + margin * max(0, output_tokens) * per_token


class StallWatch:
    """One engine's progress: stalled once its progress counter has not moved for
    ``stall_s`` while it held work. A reading that could not be taken (the engine did not
    answer its probe) is no progress; an engine that exports no counter at all is never
    judged (``observe`` with ``counter=None`` and ``answered=True``)."""

    __slots__ = ("counter", "since", "stall_s", "stalled")

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.counter: float | None = None
        self.since: float | None = None  # when the counter last moved, or work began
        self.stalled = False

    def observe(self, now: float, *, counter: float | None, answered: bool, busy: bool) -> bool:
        """Take one reading; return whether the engine is stalled now. ``busy``: it holds work
        (requests sent to it and not ended); ``answered``: its probe was answered."""
        moved = counter is not None and counter != self.counter
        if counter is not None:
            self.counter = counter
        if not busy or moved or (answered and counter is None):
            self.since = now
            self.stalled = False
            return False
        if self.since is None:
            self.since = now
        self.stalled = now - self.since >= self.stall_s
        return self.stalled
