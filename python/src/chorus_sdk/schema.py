"""JSON Schema as the SDK checks payloads with it (a verified task's output): a schema compiled
once, in the dialect its ``$schema`` names (2020-12 by default), and where a value breaks it.

The engine is ``jsonschema_rs``, the Python binding of the Rust crate the Rust SDK compiles
schemas with (``chorus_sdk::schema::Schema``), so both SDKs accept and refuse the same schemas
and the same values, with the same messages. As in the Rust SDK, a schema is never fetched from
the network or the disk: a ``$ref`` to a schema that is not inside it does not compile."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema_rs

from .codec import DecodeError, decode_payload
from .envelope import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK


class SchemaError(ValueError):
    """A JSON Schema that does not compile; the message says why."""


def _refuse(uri: str) -> Any:
    raise ValueError(f"{uri} is not fetched: a schema must hold every schema it refers to")


def _pointer(path: Any) -> str:
    """A place in a value as a JSON Pointer (``/items/0``), as the Rust SDK writes it."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


class Schema:
    """A compiled JSON Schema (``chorus_sdk::schema::Schema`` in the Rust SDK)."""

    def __init__(self, validator: Any, source: Any) -> None:
        self._validator = validator
        self.source = source

    @classmethod
    def compile(cls, schema: Any) -> Schema:
        """Compiles ``schema`` (a JSON value: a dict, or ``True``/``False``). Raises
        :class:`SchemaError` with the reason when it does not compile."""
        try:
            json_value(schema)
        except ValueError as e:
            raise SchemaError(f"the JSON Schema does not compile: it is not JSON ({e})") from e
        try:
            validator = jsonschema_rs.validator_for(schema, retriever=_refuse)
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as e:
            message = getattr(e, "message", None) or str(e).splitlines()[0]
            raise SchemaError(f"the JSON Schema does not compile: {message}") from e
        except (ValueError, TypeError) as e:
            raise SchemaError(f"the JSON Schema does not compile: {e}") from e
        return cls(validator, schema)

    def errors(self, value: Any, limit: int | None = None) -> list[str]:
        """How ``value`` breaks the schema, at most ``limit`` ways (all when ``None``), each at
        its place (``/n: "one" is not of type "integer"``); empty when it holds."""
        out: list[str] = []
        for error in self._validator.iter_errors(value):
            if limit is not None and len(out) >= limit:
                break
            at = _pointer(error.instance_path)
            out.append(f"{at}: {error.message}" if at else str(error.message))
        return out

    def is_valid(self, value: Any) -> bool:
        """Whether ``value`` meets the schema."""
        return bool(self._validator.is_valid(value))

    def __repr__(self) -> str:
        return "Schema(...)"


def json_value(value: Any) -> Any:
    """``value`` as a JSON value (what the Rust SDK reads a payload into with
    ``serde_json::Value``): maps with string keys, lists, strings, numbers, booleans and null;
    a non-finite float reads as null. Raises :class:`ValueError` for anything else (bytes, a
    map with another key)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"a map key is not a string: {k!r}")
            out[k] = json_value(v)
        return out
    raise ValueError(f"{type(value).__name__} is not a JSON value")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def payload_json(payload: bytes, content_type: str = CONTENT_TYPE_MSGPACK) -> Any:
    """A payload read as a JSON value (MessagePack or JSON). Raises :class:`ValueError` when
    it does not read, or holds something JSON has not."""
    base = content_type.split(";")[0].strip()
    try:
        if base == CONTENT_TYPE_JSON:
            return json_value(json.loads(payload, parse_constant=_no_constant))
        return json_value(decode_payload(payload, content_type))
    except DecodeError as e:
        raise ValueError(e.reason) from e
    except RecursionError as e:
        raise ValueError("nested too deeply") from e


__all__ = ["Schema", "SchemaError", "json_value", "payload_json"]
