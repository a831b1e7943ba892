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

from stage_operator.api.base import ApiModel, cel, check_exactly_one, exactly_one
from stage_runtime.model_catalog import tiny_kinds

_CAMEL = ApiModel.model_config
# `builtin`: one tiny model per kind the runtime builds (its adapters' `tiny_kinds`, read without torch).
BUILTIN_MODELS = tuple(f"tiny-{kind}" for kind in tiny_kinds())
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PvcSource(ApiModel):
    """A PersistentVolumeClaim holding the pipeline folder, mounted in the stage container at
    /opt/diffstage/model-source."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.subPath) || (!self.subPath.startsWith('/') && !self.subPath.matches('(^|/)[.][.](/|$)'))",
        "'model.source.pvc.subPath must be a relative path without .. (got ' + self.subPath + ')'")]})
    claim_name: str = Field(min_length=1, max_length=253, description=(
        "The claim's name, in the stage's namespace; the pods stay Pending until it can be mounted."))
    sub_path: str | None = Field(None, min_length=1, max_length=1024, description=(
        "The pipeline folder inside the claim, relative and without .. (default: the claim's root)."))
    read_only: bool = Field(True, description="Mount the claim read-only (default true): the stage only reads it.")

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, v: str | None) -> str | None:
        if v is not None and (v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"model.source.pvc.subPath must be a relative path without .. (got {v})")
        return v


class ImageSource(ApiModel):
    """An OCI image holding the pipeline, at /opt/diffstage/model-image in the stage container: an image
    volume, or a copy an init container (`copy-model`, which needs `cp` in the image) makes; see imageVolume."""

    reference: str = Field(min_length=1, max_length=1024, description=(
        "The image, e.g. registry.example.com/models/sd-turbo:v1; when pinned by @sha256:…, that digest shows "
        "in status.model.digest."))
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, description=(
        "When the kubelet pulls the image; default: Kubernetes' (Always for :latest or no tag, else IfNotPresent)."))
    path: str = Field("/models", pattern=r"^/", max_length=1024, description=(
        "The pipeline folder inside the image, absolute (default /models)."))


class UriSource(ApiModel):
    """An archive an init container (`fetch-model`) downloads, verifies and unpacks before the stage starts;
    a failed download or a checksum mismatch is retried with the restart backoff; an archive that is not a
    pipeline is not (exit 2, Stalled)."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        cel("self.sha256.matches('^[0-9a-f]{64}$')",
            "'model.source.uri.sha256 must be 64 lowercase hex digits (the SHA-256 of the archive), got \"' "
            "+ self.sha256 + '\"'"),
        cel("self.url.startsWith('https://') || self.url.startsWith('http://')",
            "'model.source.uri.url must be an http:// or https:// URL, got \"' + self.url + '\"'")]})
    url: str = Field(min_length=1, max_length=4096, description=(
        "An http:// or https:// URL of a tar, tar.gz or zip of a diffusers pipeline folder."))
    sha256: str = Field(max_length=128, description="The SHA-256 of the archive (64 lowercase hex digits).")

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
    """A pipeline the operator brings into the pod: exactly one of `pvc`, `image` or `uri`."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        exactly_one(_SOURCES, "model.source")]})
    pvc: PvcSource | None = None
    image: ImageSource | None = None
    uri: UriSource | None = None

    @model_validator(mode="after")
    def _one(self) -> Source:
        check_exactly_one(self, _SOURCES, "model.source")
        return self

    @property
    def kind(self) -> str:
        return next(f for f in _SOURCES if getattr(self, f) is not None)


class CacheClaim(ApiModel):
    """A PersistentVolumeClaim holding the cache; unlike hostPath, allowed by the restricted Pod Security level."""

    claim_name: str = Field(min_length=1, max_length=253, description="The claim's name, in the stage's namespace.")


class ModelCacheSpec(ApiModel):
    """A node-local cache for `source.uri` downloads, by digest, mounted at /var/cache/diffstage in
    `fetch-model` and the stage: a hostPath (one per node) or a claim. Only with `source.uri`."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        exactly_one(("hostPath", "pvc"), "model.cache")]})
    host_path: str | None = Field(None, pattern=r"^/", max_length=1024, description=(
        "An absolute folder on the node, created if missing. The baseline and restricted Pod Security levels "
        "forbid hostPath volumes: use pvc there."))
    pvc: CacheClaim | None = None
    max_bytes: int = Field(ge=1, description=(
        "Bytes the cache may hold; above it the least recently used models are evicted (never one in use)."))

    @model_validator(mode="after")
    def _one(self) -> ModelCacheSpec:
        check_exactly_one(self, ("host_path", "pvc"), "model.cache")
        return self


_MODEL = ("builtin", "path", "source")


class ModelSource(ApiModel):
    """The diffusers pipeline the stage serves: exactly one of `builtin`, `path` or `source` (CEL);
    `name` is the model name clients send. Changing it rolls the pods."""

    model_config = ConfigDict(**_CAMEL, json_schema_extra={"x-kubernetes-validations": [
        exactly_one(_MODEL, "model"),
        cel("!has(self.cache) || (has(self.source) && has(self.source.uri))",
            "'model.cache applies to model.source.uri only (it stores downloads)'")]})
    builtin: Literal[BUILTIN_MODELS] | None = Field(None, description=(
        "A tiny model an init container builds (`stage-runtime make-tiny-model`): for trying the stage and tests. "
        "All but tiny-digits have random weights and draw noise; tiny-digits is a DiT trained on handwritten "
        "digits (prompts \"0\"..\"9\"), shipped in the runtime."))
    path: str | None = Field(None, min_length=1, description=(
        "A diffusers pipeline folder (with model_index.json) already in the pod: in `image` or on a podTemplate "
        "volume. Not there: the stage exits 2 (Stalled, InvalidConfiguration)."))
    source: Source | None = None
    image_volume: Literal["auto", "always", "never"] = Field(
        "auto", description="source.image as an image volume (always), an init container copy (never), or "
                            "by what the cluster supports (auto, the default: image volumes from Kubernetes 1.35).")
    cache: ModelCacheSpec | None = None
    name: str | None = Field(None, min_length=1, description=(
        "The served model name, the `model` clients send (default: the stage's name)."))
    dtype: Literal["float32", "float16", "bfloat16"] | None = Field(None, description=(
        "The weights' dtype: float32, float16 or bfloat16 (default: the runtime's, float32)."))

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        check_exactly_one(self, _MODEL, "model")
        if self.cache is not None and (self.source is None or self.source.uri is None):
            raise ValueError("model.cache applies to model.source.uri only (it stores downloads)")
        return self
