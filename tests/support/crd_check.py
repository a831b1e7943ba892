"""What the API server does with a CRD that the emulator does not: defaulting, schema and CEL validation.

`admit(crd, obj)` applies the structural defaults, validates against the OpenAPI schema with `jsonschema`
and evaluates every `x-kubernetes-validations` rule with a CEL library from PyPI (`cel`), returning the
error messages a `kubectl apply` would print (messageExpression evaluated). Not covered: transition rules
(`oldSelf`), CEL cost limits, format validation.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import cel
import jsonschema


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd['spec']['versions'][0]['schema']['openAPIV3Schema']


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: a missing property with a default gets it, recursively."""
    if not isinstance(value, dict) or schema.get('type') != 'object':
        if isinstance(value, list) and 'items' in schema:
            return [apply_defaults(schema['items'], item) for item in value]
        return value
    out = dict(value)
    for name, sub in (schema.get('properties') or {}).items():
        if name not in out and 'default' in sub:
            out[name] = copy.deepcopy(sub['default'])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


def _rules(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    for rule in schema.get('x-kubernetes-validations') or ():
        yield path, rule, value
    if isinstance(value, dict):
        for name, sub in (schema.get('properties') or {}).items():
            if name in value:
                yield from _rules(sub, value[name], f'{path}.{name}')
    elif isinstance(value, list) and 'items' in schema:
        for i, item in enumerate(value):
            yield from _rules(schema['items'], item, f'{path}[{i}]')


def cel_messages(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """`path: message` for every failing CEL rule (the object is defaulted first)."""
    out = []
    for path, rule, value in _rules(schema, apply_defaults(schema, obj), ''):
        if cel.evaluate(rule['rule'], {'self': value}) is not True:
            message = cel.evaluate(rule['messageExpression'], {'self': value}) if 'messageExpression' in rule \
                else rule.get('message', f'failed rule: {rule["rule"]}')
            out.append(f'{path.lstrip(".")}: {message}')
    return out


def schema_messages(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f'{".".join(map(str, e.absolute_path))}: {e.message}' for e in validator.iter_errors(apply_defaults(schema, obj))]


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    schema = version_schema(crd)
    return schema_messages(schema, obj) or cel_messages(schema, obj)
