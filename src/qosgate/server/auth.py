"""Who is asking: the API key of a request (``Authorization: Bearer``, else ``x-api-key``), its
QoS headers (``x-qos-class``, ``x-qos-priority``), the conversation it belongs to (the session
header, ``fleet.cache.session_header``), the client's own request id (``X-Request-Id``, for the
request log), and the messages of a refused key."""

from __future__ import annotations

from dataclasses import dataclass

from qosgate.core import QosInputError
from qosgate.server.asgi import Scope, header


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    """The request headers the gateway reads for a completion, found in one pass."""

    api_key: str | None  # Authorization: Bearer KEY, else x-api-key: KEY
    qos_class: bytes | None  # x-qos-class
    qos_priority: bytes | None  # x-qos-priority
    session: bytes | None = None  # the session header's value, unchecked (``session_id``)
    batch_line: bool = False  # a Batch API job's line (``BATCH_LINE`` in its scope)
    client_id: bytes | None = None  # X-Request-Id: the client's name for it, never the gateway's


# the scope key that marks a Batch API job's line run through the gateway's own flow: set in
# memory only, so no client can claim it
BATCH_LINE = "qosgate.batch_line"

# the client's X-Request-Id as the request log repeats it: bounded
MAX_CLIENT_ID_CHARS = 128


def client_request_id(value: bytes | None) -> str | None:
    """The client's ``X-Request-Id`` as the request log writes it: at most
    ``MAX_CLIENT_ID_CHARS`` characters (a header is latin-1)."""
    return None if value is None else value[:MAX_CLIENT_ID_CHARS].decode("latin-1")


# a session id is a key the gateway keeps while the conversation lasts: bounded, printable
MAX_SESSION_CHARS = 256


def read_headers(scope: Scope, session_header: bytes = b"x-session-id") -> RequestHeaders:
    """The headers of ``RequestHeaders`` in one pass over the request's (the first of each
    counts); ``session_header`` in lower case."""
    authorization: bytes | None = None
    api_key: bytes | None = None
    qos_class: bytes | None = None
    qos_priority: bytes | None = None
    session: bytes | None = None
    client_id: bytes | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == session_header:
            if session is None:
                session = value
        elif name == b"x-qos-class":
            if qos_class is None:
                qos_class = value
        elif name == b"x-qos-priority":
            if qos_priority is None:
                qos_priority = value
        elif name == b"x-api-key":
            if api_key is None:
                api_key = value
        elif name == b"x-request-id" and client_id is None:
            client_id = value
    key = key_of(authorization)
    if key is None:
        key = plain_key(api_key)
    return RequestHeaders(key, qos_class, qos_priority, session, bool(scope.get(BATCH_LINE)),
                          client_id)


def session_id(value: bytes | str) -> str | None:
    """A session header's (or ``user`` field's) value as a session id: printable ASCII (space
    to ``~``), 1 to ``MAX_SESSION_CHARS`` characters after trimming spaces; None if it is not
    one."""
    text = value.strip() if isinstance(value, str) else value.strip().decode("latin-1")
    if not 0 < len(text) <= MAX_SESSION_CHARS or not text.isascii() or not text.isprintable():
        return None
    return text


def session_message(header: str) -> str:
    """The message of a refused session header."""
    return (f"The {header} header must be 1 to {MAX_SESSION_CHARS} printable ASCII characters "
            "(it names the conversation the request belongs to).")


def key_of(auth: bytes | None) -> str | None:
    """The API key of an ``Authorization: Bearer`` header value."""
    if auth is None:
        return None
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip().decode("latin-1") or None
    return None


def request_key(scope: Scope) -> str | None:
    """The request's API key: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``."""
    key = key_of(header(scope, b"authorization"))
    if key is None:
        key = plain_key(header(scope, b"x-api-key"))
    return key


def plain_key(value: bytes | None) -> str | None:
    """The API key of an ``x-api-key`` header value."""
    if value is None:
        return None
    return value.strip().decode("latin-1") or None


def denied_message(exc: QosInputError, scope: Scope) -> str:
    """A refused key's message; an ``Authorization`` header sent without the ``Bearer`` scheme
    (or with no key after it) says so, rather than that no key was sent."""
    if exc.code == "invalid_api_key" and request_key(scope) is None:
        auth = header(scope, b"authorization")
        if auth is not None and auth.strip():
            return ("The Authorization header must be 'Bearer <key>' (the API key after the "
                    "word Bearer and a space).")
    return exc.message


def input_param(exc: QosInputError, class_header: bytes | None) -> str | None:
    """The ``param`` of a refused QoS input: the header when the class came from it."""
    if exc.param == "qos_class" and class_header is not None:
        return "x-qos-class"
    return exc.param


