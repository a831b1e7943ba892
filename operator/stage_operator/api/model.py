"""`spec.model`: where the pipeline comes from and how it reaches the pod (docs/crd.md, "Model delivery").

Exactly one of `builtin` (a tiny model the pod builds), `path` (a folder already in the image or a volume
of `podTemplate`) or `source`, which has exactly one of
- `pvc`: a PersistentVolumeClaim holding the pipeline, mounted read-only at a fixed path;
- `image`: an OCI image holding it (at `path`, default /models), as a Kubernetes image volume or, on
  clusters without them (`imageVolume`), copied out by an init container running that image;
- `uri`: an http(s) tar / tar.gz / zip archive, fetched by an init container (`stage-runtime fetch-model`)
  and verified against `sha256`; with `cache` it is stored per node by digest and reused.
CEL rules here are what `kubectl apply` refuses; the pydantic validators say the same for the operator.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from stage_operator.api.base import ApiModel, cel

_CAMEL = ApiModel.model_config
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _count(fields: tuple[str, ...]) -> str:
    return " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)


def _exactly_one(fields: tuple[str, ...], where: str) -> dict:
    names = ", ".join(fields[:-1]) + f" or {fields[-1]}"
    return cel(f"{_count(fields)} == 1", f"'{where}: set exactly one of {names}'")


def _check_one(obj: ApiModel, fields: tuple[str, ...], where: str) -> None:
    if sum(getattr(obj, f) is not None for f in fields) != 1:
        wire = [type(obj).model_fields[f].alias or f for f in fields]
        names = ", ".join(wire[:-1]) + f" or {wire[-1]}"
        given = [w for f, w in zip(fields, wire, strict=True) if getattr(obj, f) is not None]
        raise ValueError(f"{where}: set exactly one of {names} (given: {', '.join(given) or 'none'})")


class PvcSource(ApiModel):
    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.subPath) || (!self.subPath.startsWith('/') && !self.subPath.matches('(^|/)[.][.](/|$)'))",
        "'model.source.pvc.subPath must be a relative path without .. (got ' + self.subPath + ')'")]})
    claim_name: str = Field(min_length=1, max_length=253)
    sub_path: str | None = Field(None, min_length=1, max_length=1024, description="the pipeline folder in the claim")
    read_only: bool = True

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, v: str | None) -> str | None:
        if v is not None and (v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"model.source.pvc.subPath must be a relative path without .. (got {v})")
        return v


class ImageSource(ApiModel):
    reference: str = Field(min_length=1, max_length=1024, description="the OCI image holding the pipeline")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    path: str = Field("/models", pattern=r"^/", max_length=1024, description="the pipeline folder in the image")


class UriSource(ApiModel):
    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        cel("self.sha256.matches('^[0-9a-f]{64}$')",
            "'model.source.uri.sha256 must be 64 lowercase hex digits (the SHA-256 of the archive), got \"' "
            "+ self.sha256 + '\"'"),
        cel("self.url.startsWith('https://') || self.url.startsWith('http://')",
            "'model.source.uri.url must be an http:// or https:// URL, got \"' + self.url + '\"'")]})
    url: str = Field(min_length=1, max_length=4096, description="a tar, tar.gz or zip of a diffusers pipeline folder")
    sha256: str = Field(max_length=128, description="the SHA-256 of the archive (64 lowercase hex digits)")

    @field_validator("sha256")
    @classmethod
    def _digest(cls, v: str) -> str:
        if not SHA256.match(v):
            raise ValueError(f'model.source.uri.sha256 must be 64 lowercase hex digits (the SHA-256 of the '
                             f'archive), got "{v}"')
        return v

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("https://", "http://")):
            raise ValueError(f'model.source.uri.url must be an http:// or https:// URL, got "{v}"')
        return v


_SOURCES = ("pvc", "image", "uri")


class Source(ApiModel):
    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        _exactly_one(_SOURCES, "model.source")]})
    pvc: PvcSource | None = None
    image: ImageSource | None = None
    uri: UriSource | None = None

    @model_validator(mode="after")
    def _one(self) -> Source:
        _check_one(self, _SOURCES, "model.source")
        return self

    @property
    def kind(self) -> str:
        return next(f for f in _SOURCES if getattr(self, f) is not None)


class CacheClaim(ApiModel):
    claim_name: str = Field(min_length=1, max_length=253)


class ModelCacheSpec(ApiModel):
    """A node-local cache for `source.uri` downloads: a hostPath (one per node) or a claim."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        _exactly_one(("hostPath", "pvc"), "model.cache")]})
    host_path: str | None = Field(None, pattern=r"^/", max_length=1024)
    pvc: CacheClaim | None = None
    max_bytes: int = Field(ge=1, description="evict least recently used models (never one in use) above this")

    @model_validator(mode="after")
    def _one(self) -> ModelCacheSpec:
        _check_one(self, ("host_path", "pvc"), "model.cache")
        return self


_MODEL = ("builtin", "path", "source")


class ModelSource(ApiModel):
    """Exactly one of `builtin`, `path` or `source`; `name` is the served model name."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        _exactly_one(_MODEL, "model"),
        cel("!has(self.cache) || (has(self.source) && has(self.source.uri))",
            "'model.cache applies to model.source.uri only (it stores downloads)'")]})
    builtin: Literal["tiny-sd", "tiny-dit", "tiny-sd3", "tiny-flux", "tiny-sdxl", "tiny-qwen-image",
                     "tiny-flux-kontext"] | None = None
    path: str | None = Field(None, min_length=1)
    source: Source | None = None
    image_volume: Literal["auto", "always", "never"] = Field(
        "auto", description="source.image as an image volume (always), an init container copy (never), or "
                            "by what the cluster supports (auto: image volumes from Kubernetes 1.35)")
    cache: ModelCacheSpec | None = None
    name: str | None = Field(None, min_length=1, description="served model name (default: the stage name)")
    dtype: Literal["float32", "float16", "bfloat16"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        _check_one(self, _MODEL, "model")
        if self.cache is not None and (self.source is None or self.source.uri is None):
            raise ValueError("model.cache applies to model.source.uri only (it stores downloads)")
        return self
