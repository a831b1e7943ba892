"""What kube-apiserver does with a custom resource before it stores it: the CRD's structural schema (prune
unknown fields, drop nulls, default, validate types, enums, bounds, required) and its CEL rules
(`x-kubernetes-validations`, `oldSelf` for transition rules), refused as kube-apiserver refuses.

    errors = validate(schema, obj, old)      # [FieldError]; empty: admitted
    pruned = prune(schema, obj)               # the paths it dropped, for fieldValidation=Strict

Messages follow apimachinery's `field.Error` (`spec.x: Invalid value: 3: spec.x in body should be less than
or equal to 2`) and kube-openapi's validator wording; the Status body is built by `invalid()` as the API
conventions give it (422, reason Invalid, details.causes). Not emulated: validation ratcheting, CEL cost
limits, `format`, `x-kubernetes-list-type` uniqueness, embedded resources, `x-kubernetes-int-or-string`
beyond accepting both types.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import cel

Schema = dict[str, Any]
ROOT_KEPT = ('apiVersion', 'kind', 'metadata')  # never pruned: the API machinery owns them
BLOCKING = ('FieldValueTypeInvalid', 'FieldValueNotSupported')  # CEL is not run over an object with these
TYPES = {'string': str, 'boolean': bool, 'object': dict, 'array': list}


@dataclasses.dataclass(frozen=True)
class FieldError:
    """One `field.Error`: a cause of a 422 Invalid Status."""

    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, FieldValueTypeInvalid, ...
    field: str
    detail: str  # the cause's message: 'Invalid value: 3: spec.x in body should be ...'

    def __str__(self) -> str:
        return f'{self.field}: {self.detail}' if self.field else self.detail


def _quote(value: Any) -> str:
    """How `field.Error` prints a bad value: strings quoted, numbers and booleans bare, objects as their type."""
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if value is None:
        return '"null"'
    return json.dumps(value if isinstance(value, str) else _type_name(value))


def _type_name(value: Any) -> str:
    for name, kind in TYPES.items():
        if isinstance(value, kind):
            return name
    if isinstance(value, bool):
        return 'boolean'
    return 'integer' if isinstance(value, int) else 'number' if isinstance(value, float) else 'null'


def invalid(path: str, value: Any, message: str) -> FieldError:
    return FieldError('FieldValueInvalid', path, f'Invalid value: {_quote(value)}: {message}')


# -- pruning, nulls, defaults --------------------------------------------------------------------------------
def prune(schema: Schema, value: Any, path: str = '', root: bool = True) -> list[str]:
    """Drop, in place, every field the schema does not declare (unless it preserves unknown fields) and every
    null of a non-nullable field; the dotted paths of the unknown fields dropped."""
    dropped: list[str] = []
    if isinstance(value, dict):
        props = schema.get('properties')
        extra = schema.get('additionalProperties')
        preserve = schema.get('x-kubernetes-preserve-unknown-fields') is True or extra is True
        for key in list(value):
            sub = (props or {}).get(key)
            if root and key in ROOT_KEPT:
                continue
            if sub is None and isinstance(extra, dict):
                sub = extra
            if sub is None:
                if not preserve:  # structural: an undeclared field goes, even under a bare `type: object`
                    del value[key]
                    dropped.append(f'{path}.{key}'.lstrip('.'))
                continue
            if value[key] is None and not sub.get('nullable'):
                del value[key]
                continue
            dropped += prune(sub, value[key], f'{path}.{key}', root=False)
    elif isinstance(value, list) and isinstance(schema.get('items'), dict):
        for i, item in enumerate(value):
            dropped += prune(schema['items'], item, f'{path}[{i}]', root=False)
    return dropped


def default(schema: Schema, value: Any) -> Any:
    """Structural defaulting, in place: a missing property with a default gets a copy of it, recursively."""
    if isinstance(value, dict):
        for key, sub in (schema.get('properties') or {}).items():
            if key not in value and 'default' in sub:
                value[key] = copy.deepcopy(sub['default'])
            if key in value:
                default(sub, value[key])
        if isinstance(schema.get('additionalProperties'), dict):
            for key in set(value) - set(schema.get('properties') or {}):
                default(schema['additionalProperties'], value[key])
    elif isinstance(value, list) and isinstance(schema.get('items'), dict):
        for item in value:
            default(schema['items'], item)
    return value


# -- the OpenAPI part --------------------------------------------------------------------------------------
def _is_type(kind: str, value: Any) -> bool:
    if kind == 'integer':
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == 'number':
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[kind]) if kind in TYPES else True


def schema_errors(schema: Schema, value: Any, path: str) -> Iterator[FieldError]:
    kind = schema.get('type')
    if value is None and schema.get('nullable'):
        return
    if schema.get('x-kubernetes-int-or-string'):
        if not (isinstance(value, str) or _is_type('integer', value)):
            yield FieldError('FieldValueTypeInvalid', path, f'Invalid value: {_quote(value)}: {path} in body must be '
                                                            f'of type integer,string: {json.dumps(_type_name(value))}')
        return
    if kind and not _is_type(kind, value):
        yield FieldError('FieldValueTypeInvalid', path,
                         f'Invalid value: {json.dumps(_type_name(value))}: {path} in body must be of type {kind}: '
                         f'{json.dumps(_type_name(value))}')
        return
    if 'enum' in schema and value not in schema['enum']:
        supported = ', '.join(json.dumps(v) for v in schema['enum'])
        yield FieldError('FieldValueNotSupported', path, f'Unsupported value: {_quote(value)}: supported values: '
                                                         f'{supported}')
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if 'maximum' in schema and (value >= schema['maximum'] if schema.get('exclusiveMaximum')
                                    else value > schema['maximum']):
            word = 'less than' if schema.get('exclusiveMaximum') else 'less than or equal to'
            yield invalid(path, value, f'{path} in body should be {word} {schema["maximum"]}')
        if 'minimum' in schema and (value <= schema['minimum'] if schema.get('exclusiveMinimum')
                                    else value < schema['minimum']):
            word = 'greater than' if schema.get('exclusiveMinimum') else 'greater than or equal to'
            yield invalid(path, value, f'{path} in body should be {word} {schema["minimum"]}')
    if isinstance(value, str):
        if 'minLength' in schema and len(value) < schema['minLength']:
            yield invalid(path, value, f'{path} in body should be at least {schema["minLength"]} chars long')
        if 'maxLength' in schema and len(value) > schema['maxLength']:
            yield FieldError('FieldValueTooLong', path, f'Too long: may not be more than {schema["maxLength"]} bytes')
        if 'pattern' in schema and not re.search(schema['pattern'], value):
            yield invalid(path, value, f"{path} in body should match '{schema['pattern']}'")
    if isinstance(value, list):
        if 'minItems' in schema and len(value) < schema['minItems']:
            yield invalid(path, value, f'{path} in body should have at least {schema["minItems"]} items')
        if 'maxItems' in schema and len(value) > schema['maxItems']:
            yield FieldError('FieldValueTooMany', path, f'Too many: {len(value)}: must have at most '
                                                        f'{schema["maxItems"]} items')
        for i, item in enumerate(value):
            if isinstance(schema.get('items'), dict):
                yield from schema_errors(schema['items'], item, f'{path}[{i}]')
    if isinstance(value, dict):
        for key in schema.get('required') or ():
            if key not in value:
                yield FieldError('FieldValueRequired', f'{path}.{key}'.lstrip('.'), 'Required value')
        for key, item in value.items():
            sub = (schema.get('properties') or {}).get(key)
            if sub is None and isinstance(schema.get('additionalProperties'), dict):
                sub = schema['additionalProperties']
            if sub is not None and not (path == '' and key in ROOT_KEPT):
                yield from schema_errors(sub, item, f'{path}.{key}'.lstrip('.'))


# -- the CEL part ---------------------------------------------------------------------------------------------
_MISSING = object()


def _rules(schema: Schema, value: Any, old: Any, path: str) -> Iterator[tuple[str, Schema, Any, Any, str]]:
    for rule in schema.get('x-kubernetes-validations') or ():
        yield path, rule, value, old, schema.get('type') or _type_name(value)
    if isinstance(value, dict):
        for key, sub in (schema.get('properties') or {}).items():
            if key in value:
                was = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
                yield from _rules(sub, value[key], was, f'{path}.{key}'.lstrip('.'))
    elif isinstance(value, list) and isinstance(schema.get('items'), dict):
        for i, item in enumerate(value):  # transition rules on list items would need list-map keys: not here
            yield from _rules(schema['items'], item, _MISSING, f'{path}[{i}]')


def cel_errors(schema: Schema, value: Any, old: Any = _MISSING) -> Iterator[FieldError]:
    for path, rule, new, was, kind in _rules(schema, value, old, ''):  # errors show the node's type, not its value
        transition = re.search(r'\boldSelf\b', rule['rule']) is not None
        if transition and was is _MISSING:
            continue  # a transition rule runs only on an update where the old value exists
        context = {'self': new, **({'oldSelf': was} if transition else {})}
        field = path + (rule.get('fieldPath') or '')
        try:
            passed = cel.evaluate(rule['rule'], context) is True
        except Exception as exc:  # noqa: BLE001 (a rule that fails to evaluate refuses, as in the API server)
            detail = f'Invalid value: {json.dumps(kind)}: {_eval_error(exc)} evaluating rule: {rule["rule"]}'
            yield FieldError('FieldValueInvalid', field.lstrip('.'), detail)
            continue
        if passed:
            continue
        yield _rule_error(rule, context, field.lstrip('.'), kind)


def _eval_error(exc: Exception) -> str:
    return f'no such key: {exc.args[0]}' if isinstance(exc, KeyError) and exc.args else str(exc)


def _rule_error(rule: Schema, context: dict[str, Any], field: str, kind: str) -> FieldError:
    message = None
    if 'messageExpression' in rule:
        try:
            result = cel.evaluate(rule['messageExpression'], context)
            message = result if isinstance(result, str) and result.strip() else None
        except Exception:  # noqa: BLE001 (the API server falls back to the static message too)
            message = None
    message = message or rule.get('message') or f'failed rule: {rule["rule"]}'
    reason = rule.get('reason') or 'FieldValueInvalid'
    if reason == 'FieldValueForbidden':
        return FieldError(reason, field, f'Forbidden: {message}')
    if reason == 'FieldValueRequired':
        return FieldError(reason, field, f'Required value: {message}')
    if reason == 'FieldValueDuplicate':
        return FieldError(reason, field, f'Duplicate value: {json.dumps(kind)}')
    return FieldError('FieldValueInvalid', field, f'Invalid value: {json.dumps(kind)}: {message}')


def validate(schema: Schema, obj: Any, old: Any = None, subresource: str | None = None) -> list[FieldError]:
    """Every error the API server reports for a pruned and defaulted object (old: the stored one on update).
    A `status` write is checked against the status schema only; on an update, an error at a value the write
    did not change is ratcheted away (CRD validation ratcheting, on by default since 1.30)."""
    if subresource == 'status':
        status_schema = (schema.get('properties') or {}).get('status') or {}
        schema = {'type': 'object', 'properties': {'status': status_schema}}
        obj = {'status': obj['status']} if isinstance(obj, dict) and 'status' in obj else {}
        old = {'status': old['status']} if isinstance(old, dict) and 'status' in old else None
    errors = list(schema_errors(schema, obj, ''))
    if not any(e.reason in BLOCKING for e in errors):
        errors += cel_errors(schema, obj, _MISSING if old is None else old)
    if old is not None:
        errors = [e for e in errors if not _unchanged(e.field, obj, old)]
    if any(e.reason in BLOCKING for e in errors):
        errors.append(FieldError('FieldValueInvalid', '<nil>', 'Invalid value: "null": some validation rules were '
                                 'not checked because the object was invalid; correct the existing errors to '
                                 'complete validation'))
    return errors


def _at(value: Any, path: str) -> Any:
    for key, index in re.findall(r'([^.\[\]]+)|\[(\d+)\]', path):
        if key and isinstance(value, dict) and key in value:
            value = value[key]
        elif index and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return _MISSING
    return value


def _unchanged(path: str, new: Any, old: Any) -> bool:
    if path == '<nil>':
        return False
    was = _at(old, path)
    return was is not _MISSING and was == _at(new, path)


def invalid_status(kind: str, group: str, name: str, errors: list[FieldError]) -> dict[str, Any]:
    """The 422 Status body kube-apiserver answers (apierrors.NewInvalid)."""
    qualified = f'{kind}.{group}' if group else kind
    listed = str(errors[0]) if len(errors) == 1 else '[' + ', '.join(map(str, errors)) + ']'
    return {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
            'message': f'{qualified} "{name}" is invalid: {listed}', 'reason': 'Invalid',
            'details': {'name': name, 'group': group, 'kind': kind,
                        'causes': [{'reason': e.reason, 'message': e.detail, 'field': e.field} for e in errors]},
            'code': 422}
