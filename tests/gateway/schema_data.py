"""Hypothesis strategies for the JSON Schemas of /openapi.json (the subset the document uses),
and a validator to check an instance against them.

`instances(schema, doc)` draws values of the schema's shape: `$ref` into the document, `anyOf`
/ `oneOf` (one branch), `const`, `enum`, `type` (one or a list), string lengths, patterns and
`date-time`, number and integer bounds, array sizes, object properties (required ones always,
the others sometimes) and `additionalProperties` schemas. `allOf` and `if`/`then`/`else` are not
constructed: draws are filtered through `validator` instead, which checks the whole schema
(jsonschema, JSON Schema 2020-12 as OpenAPI 3.1 uses).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import jsonschema
from hypothesis import strategies as st

_MAX_EXTRA_ITEMS = 4
"""Arrays get at most this many items beyond their minimum (bodies stay small)."""


def validator(schema: dict[str, Any], doc: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """Checks instances against *schema*, whose `$ref`s point into *doc*."""
    root = {**schema, "components": doc.get("components", {})}
    return jsonschema.Draft202012Validator(
        root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def instances(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for *schema* (with *doc*'s components)."""
    check = validator(schema, doc)
    return _strategy(schema, doc).filter(check.is_valid)


def _strategy(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return _strategy(node, doc)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_strategy(branch, doc) for branch in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([_strategy({**schema, "type": k}, doc) for k in kind])
    if kind is None:
        return st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    return _BY_TYPE[kind](schema, doc)


def _string(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if schema.get("format") == "date-time":
        return st.datetimes(timezones=st.just(UTC), min_value=datetime(2000, 1, 1)).map(
            lambda d: d.isoformat()
        )
    if "pattern" in schema:
        return st.from_regex(schema["pattern"]).filter(
            lambda s: low <= len(s) and (high is None or len(s) <= high)
        )
    return st.text(min_size=low, max_size=high if high is not None else max(low, 20))


def _integer(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))


def _number(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum")
    floats = st.floats(
        min_value=low,
        max_value=high,
        exclude_min="exclusiveMinimum" in schema,
        allow_nan=False,
        allow_infinity=False,
    )
    # JSON does not tell 2 from 2.0: whole numbers too (the validator drops an excluded bound)
    whole = st.integers(
        min_value=None if low is None else math.ceil(low),
        max_value=None if high is None else math.floor(high),
    )
    return floats | whole


def _array(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    low = schema.get("minItems", 0)
    high = min(schema.get("maxItems", low + _MAX_EXTRA_ITEMS), low + _MAX_EXTRA_ITEMS)
    return st.lists(_strategy(schema.get("items", {}), doc), min_size=low, max_size=high)


@st.composite
def _object_value(draw: st.DrawFn, schema: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        if name in required or draw(st.booleans()):
            out[name] = draw(_strategy(sub, doc))
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        names = st.text(max_size=schema.get("propertyNames", {}).get("maxLength", 10))
        more = draw(st.dictionaries(names, _strategy(extra, doc), max_size=3))
        out.update({k: v for k, v in more.items() if k not in out})
    return out


def _object(schema: dict[str, Any], doc: dict[str, Any]) -> st.SearchStrategy[Any]:
    return _object_value(schema, doc)


_BY_TYPE = {
    "string": _string,
    "integer": _integer,
    "number": _number,
    "boolean": lambda schema, doc: st.booleans(),
    "null": lambda schema, doc: st.none(),
    "array": _array,
    "object": _object,
}
