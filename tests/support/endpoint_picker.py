"""The endpoint picker's side of the model-server contract, as llm-d-router documents it (the picker itself is Go and
cannot run here), for contract tests against a live stage:

- ``engine_config``: the ``core-metrics-extractor`` entry for an engine in an EndpointPickerConfig file (the one
  shipped in ``manifests/inference-gateway/``), chosen by the pod label ``llm-d.ai/engine-type``;
- ``extract``: what the extractor reads through it from a ``/metrics`` exposition parsed by ``prometheus_client``:
  a spec is a PromQL instant selector (``name`` or ``name{label=value}``); a plain spec takes the matching series
  (the latest by timestamp: the first one here, the exposition has none); the LoRA spec takes the series with the
  largest value (its value is the time its labels were set) and splits ``running_lora_adapters`` /
  ``waiting_lora_adapters`` at commas, ``max_lora`` as an integer;
- ``pool_members``: an InferencePool's endpoints: the pods that are Ready, whose labels match the pool's
  ``selector.matchLabels``, and that have no ``deletionTimestamp``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

ENGINE_LABEL = "llm-d.ai/engine-type"
_SPEC = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?$")


def engine_config(path: Path, engine: str) -> dict[str, Any]:
    config = yaml.safe_load(path.read_text())
    assert config["kind"] == "EndpointPickerConfig", config.get("kind")
    for plugin in config["plugins"]:
        if plugin["type"] == "core-metrics-extractor":
            for entry in plugin.get("parameters", {}).get("engineConfigs", ()):
                if entry["name"] == engine:
                    return entry
    raise AssertionError(f"{path} has no core-metrics-extractor engineConfigs entry named {engine!r}")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    match = _SPEC.match(spec.replace(" ", ""))
    assert match, f"not a metric spec: {spec!r}"
    labels = dict(part.split("=", 1) for part in (match["labels"] or "").split(",") if part)
    return match["name"], {k: v.strip('"') for k, v in labels.items()}


def _series(families: Mapping[str, Any], spec: str) -> list[Any]:
    name, labels = parse_spec(spec)
    family = families.get(name)
    assert family is not None, f"metric family {name!r} not found (spec {spec!r})"
    return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]


def families_of(exposition: str) -> dict[str, Any]:
    """Families by the name a picker keys them on (a counter by its ``_total`` sample name)."""
    out = {}
    for family in text_string_to_metric_families(exposition):
        out[family.name] = family
        if family.type == "counter":
            out[f"{family.name}_total"] = family
    return out


def extract(exposition: str, config: Mapping[str, Any]) -> dict[str, Any]:
    families = families_of(exposition)
    out: dict[str, Any] = {}
    for key, field in (("WaitingQueueSize", "queuedRequestsSpec"), ("RunningRequestsSize", "runningRequestsSpec"),
                       ("KVCacheUsagePercent", "kvUsageSpec")):
        if config.get(field):
            series = _series(families, config[field])
            assert series, f"no series matches {config[field]!r}"
            out[key] = int(series[0].value) if key != "KVCacheUsagePercent" else series[0].value
    if config.get("loraSpec"):
        series = _series(families, config["loraSpec"])
        if series:
            latest = max(series, key=lambda s: s.value).labels
            out["ActiveModels"] = {a for a in latest.get("running_lora_adapters", "").split(",") if a}
            out["WaitingModels"] = {a for a in latest.get("waiting_lora_adapters", "").split(",") if a}
            out["MaxActiveModels"] = int(latest["max_lora"])
    for custom in config.get("customMetrics", ()):
        series = _series(families, custom["metricSpec"])
        assert series, f"no series matches {custom['metricSpec']!r}"
        out[custom["attributeKey"]] = series[0].value
    return out


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or ())


def pool_members(pool: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """The pods the picker routes to, by name (sorted)."""
    want = pool["spec"]["selector"]["matchLabels"]
    return sorted(p["metadata"]["name"] for p in pods
                  if _ready(p) and not p["metadata"].get("deletionTimestamp")
                  and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items()))
