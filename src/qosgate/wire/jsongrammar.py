"""``response_format`` as a llama.cpp grammar: JSON mode and JSON schemas.

llama.cpp constrains sampling with a GBNF grammar; llama-cpp-python ships llama.cpp's own
JSON-schema-to-GBNF converter (``llama_cpp.llama_grammar``, pure Python), so a schema is enforced
token by token by the engine's sampler chain. JSON mode (``json_object``) is the schema
``{"type": "object"}``, as llama.cpp's server does it. The converter is imported lazily (importing
``llama_cpp`` loads the compiled library) and its result cached: a schema is converted once for
the check before admission and again when the request runs.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

ANY_OBJECT = '{"type":"object"}'
# JSON Schema keywords that llama.cpp's converter does not turn into grammar rules: a schema that
# uses one is refused rather than enforced in part (annotations such as title, description or an
# unknown format are not constraints and pass)
UNENFORCED = frozenset((
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
))
_SUBSCHEMA = ("items", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


class BadSchema(ValueError):
    """The schema cannot be turned into a grammar (invalid, or a construct llama.cpp lacks)."""


@functools.lru_cache(maxsize=64)
def schema_grammar(schema_json: str) -> str:
    """GBNF for the JSON schema ``schema_json`` (canonical JSON text); BadSchema if it has none."""
    converter: Any = importlib.import_module("llama_cpp.llama_grammar")
    keyword = unenforced(json.loads(schema_json))
    if keyword is not None:
        raise BadSchema(f"'{keyword}' cannot be enforced by llama.cpp's grammar; leave it out")
    try:
        grammar: str = converter.json_schema_to_gbnf(schema_json)
    except RecursionError:
        raise BadSchema("the schema is nested too deeply") from None
    except Exception as exc:  # the converter reports with asserts, KeyError, AttributeError...
        raise BadSchema(str(exc) or type(exc).__name__) from None
    return grammar


def schema_text(schema: object) -> str:
    """Compact JSON text of a schema, the cache key (key order kept: it is the output's order)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def unenforced(schema: object, depth: int = 0) -> str | None:
    """The first keyword of ``UNENFORCED`` in ``schema`` or any of its subschemas."""
    if depth > 64:
        raise BadSchema("the schema is nested too deeply")
    if not isinstance(schema, dict):
        return None
    found = next((k for k in schema if k in UNENFORCED), None)
    subs: list[object] = [schema.get(k) for k in _SUBSCHEMA]
    for k in _SUBSCHEMA_LISTS:
        if isinstance(v := schema.get(k), list):
            subs.extend(v)
    for k in _SUBSCHEMA_MAPS:
        if isinstance(v := schema.get(k), dict):
            subs.extend(v.values())
    for sub in subs:
        if found is not None:
            break
        found = unenforced(sub, depth + 1)
    return found
