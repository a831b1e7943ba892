"""`kubectl get dstage`, as a table: the columns are the CRD's additionalPrinterColumns (priority 0),
read from crds/diffusionstage.yaml, so the table shows what kubectl would show."""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import yaml

CRD = Path(__file__).resolve().parents[1] / 'crds' / 'diffusionstage.yaml'


def printer_columns() -> list[dict[str, Any]]:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd['spec']['versions'] if v.get('served'))
    return [c for c in version['additionalPrinterColumns'] if not c.get('priority')]


def _lookup(obj: dict[str, Any], json_path: str) -> Any:
    """The simple `.a.b.c` paths our columns use (a filter path answers None: it has priority 1)."""
    value: Any = obj
    for part in json_path.lstrip('.').split('.'):
        if not isinstance(value, dict) or '[' in part:
            return None
        value = value.get(part)
    return value


def age(timestamp: str | None, now: datetime.datetime) -> str:
    if not timestamp:
        return '<unknown>'
    seconds = int((now - datetime.datetime.fromisoformat(timestamp.replace('Z', '+00:00'))).total_seconds())
    for unit, size in (('d', 86400), ('h', 3600), ('m', 60)):
        if seconds >= 2 * size:
            return f'{seconds // size}{unit}'
    return f'{max(seconds, 0)}s'


def render(stages: list[dict[str, Any]], now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.UTC)
    columns = printer_columns()
    rows = [['NAME'] + [c['name'].upper() for c in columns]]
    for stage in stages:
        row = [stage['metadata']['name']]
        for column in columns:
            value = _lookup(stage, column['jsonPath'])
            row.append(age(value, now) if column['type'] == 'date' else '' if value is None else str(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return '\n'.join('   '.join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
