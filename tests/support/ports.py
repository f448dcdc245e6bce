"""Ports for servers a test starts: an ephemeral one for a server that binds at once, a
reserved one for a server that binds long after it is chosen."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_RESERVED: set[int] = set()
_PORTS = random.Random()  # per process: two test processes rarely start at the same port


def reserved_port() -> int:
    """A free port below the kernel's ephemeral range, for a server that binds it long after
    it is chosen (vLLM binds its HTTP port and its KV-event endpoint only once its engine is
    up, ~a minute later). ``free_port`` hands out an ephemeral port, which in that minute any
    process's ``bind(0)`` may take -- a second vLLM starting beside it did (``Address already
    in use``); no ``bind(0)`` ever returns one of these."""
    low = _PORTS.randrange(20000, 31000)
    for port in range(low, 32000):
        if port in _RESERVED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _RESERVED.add(port)
        return port
    raise RuntimeError("no free port in 20000..32000")
