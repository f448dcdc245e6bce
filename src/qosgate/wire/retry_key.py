"""What a client's retry of a request shares with its earlier attempts: its tenant and its body.

Clients retry a refused request by sending the same body again (the openai SDK does, after the
refusal's Retry-After), so a digest of the tenant and the body's bytes tells a return from a new
request without anything from the client: admission keeps room for a refused request until its
return (``core.bookings``). Two identical requests of one tenant share a key; the second then
takes the first's booking, which is the room kept for a request like it.
"""

from __future__ import annotations

import hashlib


def retry_key(tenant: str, body: bytes) -> str:
    digest = hashlib.blake2b(body, digest_size=12, person=b"qosgate-retry")
    digest.update(tenant.encode())
    return digest.hexdigest()
