"""The one module that talks to the Kubernetes API (the official client's transport and auth, plain JSON).

Reads: the stage, its pods (by label), its Service, ConfigMap, PodDisruptionBudget, NetworkPolicy and InferencePool, the
job store's PersistentVolumeClaim (spec.jobs.claimName, by name) or whether its credentials Secret exists
(spec.jobs.objectStore.credentialsSecret, by name; its metadata only), the nodes, the auth Secret (spec.auth.secretRef,
by name). Writes: `apply(stage, plan)` in the plan's order (deletes, creates, patches, status, events), and nothing
else. Every write is a JSON merge patch or a create/delete by name.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from typing import Any

import kubernetes

from stage_operator import dra
from stage_operator.api.meta import GROUP, LABEL_STAGE, PLURAL, VERSION
from stage_operator.builders.children import configmap_name
from stage_operator.builders.disruption import pdb_name
from stage_operator.builders.inference_pool import inference_pool_name
from stage_operator.builders.networkpolicy import network_policy_name
from stage_operator.observed import Observed
from stage_operator.plan import Plan
from stage_operator.stage import Stage

log = logging.getLogger(__name__)
MERGE = "application/merge-patch+json"
IMAGE_VOLUMES_SINCE = (1, 35)  # the ImageVolume feature gate is on by default from here
_CORE_PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Secret": "secrets",
                 "PersistentVolumeClaim": "persistentvolumeclaims"}
_PATHS = {"PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
          "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
          "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools")}
DRA_API = "/apis/resource.k8s.io/v1"
QUOTA_REFUSAL = "exceeded quota"  # the ResourceQuota admission plugin's 403 message: `exceeded quota: NAME, ...`


class ApiError(Exception):
    def __init__(self, method: str, path: str, status: int, body: str):
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{method} {path} answered {status}: {message}")
        self.status = status


def load_api_client() -> kubernetes.client.ApiClient:
    """In-cluster service account, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = 32
    return kubernetes.client.ApiClient(configuration)


class Kube:
    """Thread-safe (one urllib3 pool); calls block, so the async operator runs them in worker threads."""

    def __init__(self, client: kubernetes.client.ApiClient | None = None, timeout: float = 30):
        self.client = client or load_api_client()
        self.timeout = timeout
        self._image_volumes: bool | None = None
        self.calls = 0  # every request, reads included (the benchmark reports calls per reconcile)

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
                content_type: str = "application/json") -> dict[str, Any] | None:
        """The decoded answer; None for 404 on GET and DELETE; ApiError for any other failure."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.client.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
            auth_settings=["BearerToken"])
        self.calls += 1
        response = self.client.call_api(method, url, header_params=headers, body=body, _request_timeout=self.timeout)
        data = response.read()
        if response.status == 404 and method in ("GET", "DELETE"):
            return None
        if not 200 <= response.status < 300:
            raise ApiError(method, path, response.status, data.decode("utf-8", "replace"))
        return json.loads(data) if data else {}

    # -- reads -------------------------------------------------------------------------------------------
    @staticmethod
    def stage_path(namespace: str, name: str = "") -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}" + (f"/{name}" if name else "")

    @staticmethod
    def core_path(kind: str, namespace: str, name: str = "") -> str:
        """The path of a child kind (core/v1, and policy/v1 for the PodDisruptionBudget, networking.k8s.io/v1 for the NetworkPolicy)."""
        prefix, plural = _PATHS.get(kind, ("/api/v1", _CORE_PLURALS.get(kind)))
        return f"{prefix}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    def read_stage(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", self.stage_path(namespace, name))

    def image_volumes(self) -> bool:
        """Whether the API server is Kubernetes >= 1.35 (image volumes on by default); read once, and an
        answer that is not a version counts as no."""
        if self._image_volumes is None:
            try:
                info = self.request("GET", "/version") or {}
                major = int(str(info.get("major", "0")).rstrip("+"))
                minor = int(str(info.get("minor", "0")).rstrip("+"))
                self._image_volumes = (major, minor) >= IMAGE_VOLUMES_SINCE
            except (ApiError, ValueError) as exc:
                log.info("no server version (%s): image volumes are not assumed", exc)
                self._image_volumes = False
        return self._image_volumes

    def list_nodes(self) -> list[dict[str, Any]]:
        return self.request("GET", "/api/v1/nodes")["items"]

    def read_dra(self, namespace: str, claims: list[dict[str, Any]]) -> dra.Inventory:
        """What the capacity check needs of Dynamic Resource Allocation (resource.k8s.io/v1): each pod claim's
        ResourceClaimTemplate or ResourceClaim (by name), the DeviceClasses and the ResourceSlices. A cluster
        without the API (404) has none of them."""
        objects = {}
        for entry in claims:
            source = dra.claim_source(entry)
            if source is not None:
                plural = "resourceclaimtemplates" if source[0] == "ResourceClaimTemplate" else "resourceclaims"
                objects[entry.get("name", "")] = self.request(
                    "GET", f"{DRA_API}/namespaces/{namespace}/{plural}/{source[1]}")
        classes = (self.request("GET", f"{DRA_API}/deviceclasses") or {}).get("items") or []
        slices = (self.request("GET", f"{DRA_API}/resourceslices") or {}).get("items") or []
        return dra.Inventory(objects, classes, slices)

    def observe(self, stage: Stage, *, nodes: list[dict[str, Any]] | None, now: str) -> Observed:
        pods = self.request("GET", self.core_path("Pod", stage.namespace),
                            query={"labelSelector": f"{LABEL_STAGE}={stage.name}"})["items"]
        owned = [p for p in pods if any(r.get("uid") == stage.uid for r in p["metadata"].get("ownerReferences") or ())]
        service = self.request("GET", self.core_path("Service", stage.namespace, stage.name))
        configmap = self.request("GET", self.core_path("ConfigMap", stage.namespace, configmap_name(stage)))
        pdb = self.request("GET", self.core_path("PodDisruptionBudget", stage.namespace, pdb_name(stage)))
        policy = self.request("GET", self.core_path("NetworkPolicy", stage.namespace, network_policy_name(stage)))
        jobs = stage.spec.jobs if stage.spec is not None else None
        claim = None
        if jobs is not None and jobs.claim_name is not None:
            claim = self.request("GET", self.core_path("PersistentVolumeClaim", stage.namespace, jobs.claim_name))
        elif jobs is not None and jobs.object_store.credentials_secret is not None:
            claim = self._secret_exists(stage.namespace, jobs.object_store.credentials_secret)
        pool = None
        if stage.wants_inference_pool or stage.status.get("inferencePool"):  # read only where one is or was
            pool = self.request("GET", self.core_path("InferencePool", stage.namespace, inference_pool_name(stage)))
        return Observed(pods=owned, service=service, configmap=configmap, pdb=pdb, nodes=nodes, now=now,
                        network_policy=policy, jobs_claim=claim, inference_pool=pool)

    def _secret_exists(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """Whether the Secret exists (its metadata; None: not found). Reading Secrets is granted namespace by
        namespace (manifests/base/rbac.yaml): where it is not (403), the operator cannot tell and does not hold the
        stage back; a missing Secret then shows on the pods (CreateContainerConfigError)."""
        try:
            found = self.request("GET", self.core_path("Secret", namespace, name))
        except ApiError as exc:
            if exc.status != 403:
                raise
            log.info("cannot check Secret %s/%s (no get on secrets there): %s", namespace, name, exc)
            return {"metadata": {"name": name, "namespace": namespace}}
        return None if found is None else {"metadata": found.get("metadata", {})}

    def read_api_key(self, namespace: str, name: str, key: str) -> str | None:
        """The first key in the stage's auth Secret (RBAC: `get` on secrets in that namespace); None when
        the Secret or the key is missing or holds no key. What the operator sends as `Authorization: Bearer`."""
        secret = self.request("GET", self.core_path("Secret", namespace, name))
        encoded = ((secret or {}).get("data") or {}).get(key)
        if encoded is None:
            return None
        text = base64.b64decode(encoded).decode("utf-8", "replace")
        return next((line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")), None)

    # -- writes ------------------------------------------------------------------------------------------
    def apply(self, stage: Stage, plan: Plan) -> dict[str, str]:
        """The plan's writes; returns the pods a ResourceQuota refused (name → the API's message): the next
        reconcile reports them as WaitingForQuota and tries again."""
        ns, refused = stage.namespace, {}
        for delete in plan.delete:  # first: a restarted replica's failed pod frees its name for the replacement
            self.request("DELETE", self.core_path(delete.kind, ns, delete.name))
        for obj in plan.create:
            try:
                self.request("POST", self.core_path(obj["kind"], ns), body=obj)
            except ApiError as exc:
                if exc.status == 404 and obj["kind"] == "InferencePool":   # its CRD is not installed: say so
                    log.warning("cannot create InferencePool %s/%s: the InferencePool CRD (inference.networking.k8s.io"
                                "/v1) is not installed in the cluster: %s", ns, obj["metadata"]["name"], exc)
                    continue
                if exc.status == 403 and obj["kind"] == "Pod" and QUOTA_REFUSAL in str(exc):
                    refused[obj["metadata"]["name"]] = str(exc).split(" answered 403: ", 1)[-1]
                    log.info("%s refused by a ResourceQuota: %s", obj["metadata"]["name"], exc)
                    continue
                if exc.status != 409:
                    raise
                log.info("%s/%s already exists (a read older than the write): the next reconcile sees it",
                         obj["kind"], obj["metadata"]["name"])
        for patch in plan.patch:
            self.request("PATCH", self.core_path(patch.kind, ns, patch.name), body=patch.body, content_type=MERGE)
        if plan.status is not None:
            self.request("PATCH", self.stage_path(ns, stage.name) + "/status", body={"status": plan.status},
                         content_type=MERGE)
        for event in plan.events:
            self.request("POST", f"/api/v1/namespaces/{ns}/events", body=event)
        return refused
