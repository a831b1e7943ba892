"""The CRD checks of the unit tests, as one-line messages (`path: message`), from the same admission code the
emulated API server runs (e2e/local/admission.py: structural defaults, the OpenAPI schema, the CEL rules with
their messageExpression evaluated). The HTTP-level Status bodies are tested in e2e/local/test_admission.py."""
from __future__ import annotations

import copy
import re
from typing import Any

from e2e.local import admission

_INVALID = re.compile(r'^Invalid value: "[a-z]+": ')


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd['spec']['versions'][0]['schema']['openAPIV3Schema']


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it (a copy)."""
    return admission.default(schema, copy.deepcopy(value))


def cel_messages(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """`path: message` for every failing CEL rule (the object is defaulted first)."""
    return [f'{e.field}: {_INVALID.sub("", e.detail)}' for e in admission.cel_errors(schema, apply_defaults(schema, obj))]


def schema_messages(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    return [str(e) for e in admission.schema_errors(schema, apply_defaults(schema, obj), '')]


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    schema = version_schema(crd)
    return schema_messages(schema, obj) or cel_messages(schema, obj)
