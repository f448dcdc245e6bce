"""Conversations bound to the replica their last turn ran on, until idle too long.

A session (``Request.session``: the ``x-session-id`` header, or OpenAI's ``user`` where opted in)
names a conversation whose turns grow one context: the replica that ran the last turn holds its
prefix. The binding is a hint for the routers (``session-affinity``, ``cache-aware``), never a
rule: it is followed only while that replica is a candidate and not overloaded, and the next
turn placed elsewhere (it died, was ejected, was overloaded) re-binds the session there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class Binding(NamedTuple):
    replica: str
    prompt_tokens: int  # the last turn's prompt there: a prefix of the next one's, in chat
    last_used: float


class Sessions:
    """Session -> ``Binding``, forgotten ``idle_s`` after its last turn was placed."""

    __slots__ = ("_bound", "idle_s")

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        # least recently used first: expiry pops from the front
        self._bound: OrderedDict[str, Binding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, session: str, now: float) -> Binding | None:
        """Where ``session``'s last turn ran (None: unknown, or idle past the timeout)."""
        self._expire(now)
        return self._bound.get(session)

    def bind(self, session: str, replica: str, prompt_tokens: int, now: float) -> None:
        """A turn of ``session`` was placed on ``replica``."""
        bound = self._bound
        bound[session] = Binding(replica, prompt_tokens, now)
        bound.move_to_end(session)
        self._expire(now)

    def drop_replica(self, replica: str) -> None:
        """``replica`` lost its cache: its sessions hold nothing there any more."""
        for session in [s for s, b in self._bound.items() if b.replica == replica]:
            del self._bound[session]

    def _expire(self, now: float) -> None:
        bound = self._bound
        horizon = now - self.idle_s
        while bound:
            first = next(iter(bound.values()))
            if first.last_used > horizon:
                break
            bound.popitem(last=False)
