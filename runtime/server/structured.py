"""Structured output on the wire → ``Sampling.constraint`` (docs/structured.md).

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and llama-server's
extra fields ``json_schema`` (a schema object) and ``grammar`` (GBNF; ``grammar_syntax: "lark"``
for Lark), plus ``regex``: at most one of them per request. Shapes are checked here; whether the
schema or grammar itself can be enforced is the runtime's check (``invalid_schema`` /
``invalid_grammar``, with the grammar engine's words).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from runtime.errors import InvalidSchema
from runtime.messages import (
    Constraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from runtime.server.errors import HttpError, invalid

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def constraint_of(
    *,
    response_format: Any = None,
    json_schema: Any = None,
    grammar: str | None = None,
    grammar_syntax: Literal["gbnf", "lark"] | None = None,
    regex: str | None = None,
) -> Constraint | None:
    """The one constraint the request's structured-output fields ask for, or None."""
    found: list[tuple[str, Constraint]] = []
    from_format = _from_response_format(response_format)
    if from_format is not None:
        found.append(("response_format", from_format))
    if json_schema is not None:
        found.append(("json_schema", _schema_constraint("json_schema", json_schema, strict=True)))
    if grammar is not None:
        found.append(
            ("grammar", GrammarConstraint(grammar=grammar, syntax=grammar_syntax or "gbnf"))
        )
    elif grammar_syntax is not None:
        raise invalid("grammar_syntax", "grammar_syntax needs a grammar")
    if regex is not None:
        found.append(("regex", RegexConstraint(pattern=regex)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid(found[1][0], f"give at most one of {names}: output follows one constraint")
    return found[0][1] if found else None


def _from_response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise invalid(
            "response_format",
            f"response_format must be an object with type one of {', '.join(RESPONSE_FORMAT_TYPES)}"
            f" (got {value!r})",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectConstraint()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise invalid(
            "response_format",
            'response_format of type json_schema needs "json_schema": {"name": ..., "schema": '
            "{...}}",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("response_format", f"json_schema.strict must be true or false ({strict!r})")
    # Strict unless the client says false: enforcing a schema only in part is never silent.
    return _schema_constraint("response_format", spec["schema"], strict=strict is not False)


def _schema_constraint(field: str, schema: Any, *, strict: bool) -> JsonSchemaConstraint:
    if not isinstance(schema, dict | bool):
        raise HttpError(
            400,
            f"{field}: a JSON schema must be an object (got {type(schema).__name__})",
            code=InvalidSchema.code,
            param=field,
        )
    return JsonSchemaConstraint(schema=json.dumps(schema), strict=strict)
