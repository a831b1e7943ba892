"""What a pod reads from the API before a container starts: Secrets and ConfigMaps, as files and as env, and
what a kubelet does when one is missing.

- A `secret` or `configMap` volume: each key a file (`items` picks keys and names their paths), its mode
  `items[].mode`, else `defaultMode`, else 0644; a Secret's values base64-decoded, a ConfigMap's `data` as text
  and `binaryData` decoded.
- `env[].valueFrom.secretKeyRef` / `configMapKeyRef`, and `envFrom[].secretRef` / `configMapRef` (with `prefix`).
- Missing (the object, or a key that `items` or a key reference names) and not `optional`: `NotReady`, in the
  kubelet's own words. The pod does not start and the kubelet tries again: `FailedMount` for a volume (no
  container starts), `CreateContainerConfigError` for env (that container waits). Optional and missing: no file,
  no variable.
The files are written once, when the pod starts (a kubelet would also follow a changed Secret).
"""
from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

Obj = dict[str, Any]
Read = Callable[[str, str, str], 'Obj | None']  # (plural, namespace, name) → the object, or None if there is none
DEFAULT_MODE = 0o644
KINDS = {'secret': ('secrets', 'secretName'), 'configMap': ('configmaps', 'name')}  # volume source → plural, name


class PodSpecError(Exception):
    """The pod asks for something the local cluster cannot run (named in the message)."""


class NotReady(Exception):
    """Something the pod needs is not in the API (yet): `reason` is what the kubelet reports, `message` its words."""

    def __init__(self, reason: str, message: str):
        super().__init__(f'{reason}: {message}')
        self.reason, self.message = reason, message


def _values(plural: str, obj: Obj) -> dict[str, bytes]:
    if plural == 'secrets':
        return {key: base64.b64decode(value) for key, value in (obj.get('data') or {}).items()}
    values = {key: str(value).encode() for key, value in (obj.get('data') or {}).items()}
    return {**values, **{key: base64.b64decode(v) for key, v in (obj.get('binaryData') or {}).items()}}


def _missing(plural: str, name: str) -> str:
    return f'{"secret" if plural == "secrets" else "configmap"} "{name}" not found'


def volume_files(volume: Obj, namespace: str, read: Read) -> dict[str, tuple[bytes, int]]:
    """A `secret` or `configMap` volume's files: relative path → (content, mode)."""
    kind = 'secret' if 'secret' in volume else 'configMap'
    source, (plural, name_field) = volume[kind] or {}, KINDS[kind]
    name, optional = source.get(name_field), bool(source.get('optional'))
    default_mode = int(source.get('defaultMode', DEFAULT_MODE))

    def failed(why: str) -> NotReady:
        return NotReady('FailedMount', f'MountVolume.SetUp failed for volume "{volume["name"]}" : {why}')

    if not name:
        raise PodSpecError(f'volume {volume["name"]!r}: {kind}.{name_field} is required')
    obj = read(plural, namespace, name)
    if obj is None:
        if optional:
            return {}
        raise failed(_missing(plural, name))
    values = _values(plural, obj)
    if not source.get('items'):
        return {key: (value, default_mode) for key, value in values.items()}
    files = {}
    for item in source['items']:
        key = item['key']
        if key not in values:
            if optional:
                continue
            raise failed(f'references non-existent secret key: {key}' if plural == 'secrets'
                         else f'configmap references non-existent config key: {key}')
        files[_relative(volume['name'], item['path'])] = (values[key], int(item.get('mode', default_mode)))
    return files


def _relative(volume: str, path: str) -> str:
    parts = PurePosixPath(path).parts
    if not path or path.startswith('/') or '..' in parts:
        raise PodSpecError(f'volume {volume!r}: items[].path {path!r} must be relative, without ".."')
    return path


def write_files(folder: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for relative, (content, mode) in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()  # a file of an earlier try may be read-only
        path.write_bytes(content)
        os.chmod(path, mode)


def env_value(container: str, var: Obj, namespace: str, read: Read) -> str | None:
    """A `secretKeyRef` or `configMapKeyRef` variable's value; None when it is optional and missing."""
    source = var['valueFrom']
    ref_kind = 'secretKeyRef' if 'secretKeyRef' in source else 'configMapKeyRef'
    ref = source[ref_kind]
    plural, kind = ('secrets', 'Secret') if ref_kind == 'secretKeyRef' else ('configmaps', 'ConfigMap')
    name, key, optional = ref.get('name'), ref.get('key'), bool(ref.get('optional'))
    if not name or not key:
        raise PodSpecError(f'{container}: env {var["name"]!r}: {ref_kind} needs a name and a key: {ref}')
    obj = read(plural, namespace, name)
    if obj is None:
        if optional:
            return None
        raise NotReady('CreateContainerConfigError', _missing(plural, name))
    values = _values(plural, obj)
    if key not in values:
        if optional:
            return None
        raise NotReady('CreateContainerConfigError', f"couldn't find key {key} in {kind} {namespace}/{name}")
    return values[key].decode('utf-8', 'replace')


def env_from(container: str, source: Obj, namespace: str, read: Read) -> dict[str, str]:
    """An `envFrom` entry: every key of the Secret or ConfigMap, behind `prefix`."""
    ref_kind = 'secretRef' if 'secretRef' in source else 'configMapRef' if 'configMapRef' in source else None
    if ref_kind is None:
        raise PodSpecError(f'{container}: envFrom: only secretRef and configMapRef run locally: {sorted(source)}')
    ref = source[ref_kind] or {}
    plural = 'secrets' if ref_kind == 'secretRef' else 'configmaps'
    obj = read(plural, namespace, ref.get('name', ''))
    if obj is None:
        if ref.get('optional'):
            return {}
        raise NotReady('CreateContainerConfigError', _missing(plural, ref.get('name', '')))
    prefix = source.get('prefix', '')
    return {prefix + key: value.decode('utf-8', 'replace') for key, value in _values(plural, obj).items()}
