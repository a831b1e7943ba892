"""Step checkpoints on the rank: a StepRequestState into a safetensors file, and a fresh state laid over with one
(``stage_runtime.checkpoint`` has the file's manifest and the checks a resume passes).

Every family with the step contract goes through the state's fields, not through code of its own: :func:`save`
packs every field but the request (latents, step index, the noise scheduler's attributes — timesteps, sigmas, its
step index, a multistep solver's past outputs —, the generators' states, the conditioning, edit tensors, a
family's extra fields, the block cache), and :func:`restore` takes the state ``prepare_encode`` made from scratch
for the resumed request (the right classes, whatever the request alone determines) and lays every saved value
over it, so it continues at the saved step on the very same values.

How a value is packed (a JSON tree beside the file's tensors) and laid back over the fresh value at its place:

    None, bool, int, float, str       as is
    torch.Tensor                      {"tensor": name}: a CPU copy, same dtype; back on the device of the fresh
                                      tensor at its place (a new one: the device of the fresh latents)
    numpy array or scalar             {"ndarray": name[, "scalar": true]}
    torch.Generator                   {"generator": name, "device": type}: its state, set into the fresh one
    torch.dtype, torch.device         {"dtype": name}, {"device": name}
    list, tuple                       {"list": [...]}, {"tuple": [...]}
    dict                              {"dict": [[key, value], ...]} (keys None, bool, int, float, str, or tuples
                                      of them: {"tuple": [...]})
    dataclass instance                {"fields": {name: value}} (a frozen one is rebuilt with ``replace``)
    other object                      {"attrs": {name: value}}: its attributes (a noise scheduler, a guider), set
                                      on the fresh object; its frozen config is the model's (in the fingerprint)

A value of any other kind (a module, a function) is an error naming where it sits: a family that keeps one in its
step state must make it a field ``prepare_encode`` rebuilds from the request (the request is never packed).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
import types
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as serialize

from stage_runtime.atomic_file import write_atomic
from stage_runtime.checkpoint import FIELD, FORMAT, MANIFEST_KEY, check_manifest, parse_manifest, request_identity
from stage_runtime.errors import InvalidRequestError
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.step_state import StepRequestState

SKIPPED_ATTRS = frozenset({"_internal_dict"})     # a ConfigMixin's frozen config: the model's, not the request's
WEIGHT_SAMPLE = 1 << 14                           # elements of each sampled denoiser weight in the fingerprint
PRIMITIVE = (type(None), bool, int, float, str)


class CheckpointError(RuntimeError):
    """A step state holds something a checkpoint cannot carry (a programming error of the family)."""


def model_fingerprint(adapter, quantization: str = "none") -> str:
    """16 hex digits naming the loaded model: the pipeline's and components' classes, the diffusers components'
    configs (path-like keys left out) and the first elements of five of the denoiser's weights (as loaded: taken
    before any quantization), and the quantization the stage serves it with (another one computes other numbers)."""
    h = hashlib.sha256(type(adapter.pipe).__name__.encode())
    if quantization != "none":
        h.update(f"|quantization:{quantization}".encode())
    for name, component in sorted(adapter.pipe.components.items()):
        h.update(f"|{name}:{type(component).__name__}".encode())
        config = getattr(component, "config", None)
        if isinstance(config, dict):                      # diffusers' FrozenDict; transformers' configs: class only
            plain = {k: v for k, v in config.items() if not k.startswith("_")}
            h.update(json.dumps(plain, sort_keys=True, default=lambda o: type(o).__name__).encode())
    weights = [p for p in adapter.denoiser.parameters() if p.device.type != "meta"]
    for p in weights[::max(1, len(weights) // 4)][:5]:
        sample = p.detach().flatten()[:WEIGHT_SAMPLE].to("cpu").contiguous()
        h.update(repr((tuple(p.shape), str(p.dtype))).encode() + sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# -- packing --------------------------------------------------------------------------------------------------
def pack(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    def keep(tensor: torch.Tensor) -> str:
        name = f"t{len(tensors)}"
        tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return name

    if isinstance(value, PRIMITIVE):
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": keep(value)}
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype == object:
            raise CheckpointError(f"{where}: a numpy array of Python objects cannot be checkpointed")
        return {"ndarray": keep(torch.from_numpy(np.array(value, copy=True))), "scalar": isinstance(value, np.generic)}
    if isinstance(value, torch.Generator):
        return {"generator": keep(value.get_state()), "device": value.device.type}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (list, tuple)):
        items = [pack(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"list": items} if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        for key in value:
            parts = key if isinstance(key, tuple) else (key,)
            if not all(isinstance(k, PRIMITIVE) for k in parts):
                raise CheckpointError(f"{where}: a dict key of type {type(key).__name__} cannot be checkpointed")
        return {"dict": [[{"tuple": list(k)} if isinstance(k, tuple) else k, pack(v, tensors, f"{where}[{k!r}]")]
                         for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"fields": {f.name: pack(getattr(value, f.name), tensors, f"{where}.{f.name}")
                           for f in dataclasses.fields(value)}}
    if isinstance(value, (torch.nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                          functools.partial)) or not hasattr(value, "__dict__"):
        raise CheckpointError(f"{where}: a {type(value).__name__} cannot be checkpointed")
    return {"attrs": {k: pack(v, tensors, f"{where}.{k}") for k, v in vars(value).items() if k not in SKIPPED_ATTRS}}


def unpack(fresh: Any, packed: Any, tensors: dict[str, torch.Tensor], device: torch.device, where: str) -> Any:
    """The saved value, laid over ``fresh`` (the freshly prepared value at the same place, or None)."""
    if not isinstance(packed, dict):
        return packed
    if "tensor" in packed:
        return tensors[packed["tensor"]].to(fresh.device if isinstance(fresh, torch.Tensor) else device)
    if "ndarray" in packed:
        array = tensors[packed["ndarray"]].numpy()
        return array[()] if packed["scalar"] else array
    if "generator" in packed:
        generator = fresh if isinstance(fresh, torch.Generator) else torch.Generator(
            "cpu" if packed["device"] == "cpu" else device)
        generator.set_state(tensors[packed["generator"]])
        return generator
    if "dtype" in packed:
        return getattr(torch, packed["dtype"])
    if "device" in packed:
        return fresh if isinstance(fresh, torch.device) else torch.device(packed["device"])
    if "list" in packed or "tuple" in packed:
        items = packed.get("list", packed.get("tuple"))
        olds = fresh if isinstance(fresh, (list, tuple)) and len(fresh) == len(items) else [None] * len(items)
        out = [unpack(old, v, tensors, device, f"{where}[{i}]") for i, (old, v) in enumerate(zip(olds, items))]
        return out if "list" in packed else tuple(out)
    if "dict" in packed:
        olds, out = fresh if isinstance(fresh, dict) else {}, {}
        for key, v in packed["dict"]:
            key = tuple(key["tuple"]) if isinstance(key, dict) else key
            out[key] = unpack(olds.get(key), v, tensors, device, f"{where}[{key!r}]")
        return out
    if fresh is None:
        raise CheckpointError(f"{where}: the checkpoint holds an object here; the freshly prepared state none")
    if "fields" in packed:
        if not dataclasses.is_dataclass(fresh):
            raise CheckpointError(f"{where}: the checkpoint holds a dataclass here; the fresh state a "
                                  f"{type(fresh).__name__}")
        values = {k: unpack(getattr(fresh, k), v, tensors, device, f"{where}.{k}") for k, v in packed["fields"].items()}
        if type(fresh).__dataclass_params__.frozen:
            return dataclasses.replace(fresh, **values)
        for k, v in values.items():
            setattr(fresh, k, v)
        return fresh
    for k, v in packed["attrs"].items():
        setattr(fresh, k, unpack(getattr(fresh, k, None), v, tensors, device, f"{where}.{k}"))
    return fresh


# -- the file ---------------------------------------------------------------------------------------------------
def snapshot(state: StepRequestState, info: ModelInfo) -> bytes:
    """``state`` as a checkpoint file's bytes (its tensors copied to the host, the manifest beside them): what
    :func:`save` writes, or what a job's writer stores off the engine thread."""
    tensors: dict[str, torch.Tensor] = {}
    tree = {f.name: pack(getattr(state, f.name), tensors, f"state.{f.name}")
            for f in dataclasses.fields(state) if f.name != "request"}
    manifest = {"format": FORMAT, "model": info.fingerprint, "pipeline_class": info.pipeline_class,
                "request_id": state.request_id, "request": request_identity(state.request), "step": state.step_index,
                "total_steps": state.total_steps, "saved_at": time.time(), "state": tree}
    return serialize(tensors, metadata={MANIFEST_KEY: json.dumps(manifest)})


def save(state: StepRequestState, path: str | None, info: ModelInfo) -> dict[str, Any]:
    """Write ``state`` to ``path`` whole or not at all (a temp file beside it, synced, renamed over it).
    {"path", "step", "total_steps", "bytes", "seconds"}. ``path`` None: nothing is written, the bytes come back as
    ``data`` (the caller writes them elsewhere, off the engine thread)."""
    started = time.perf_counter()
    data = snapshot(state, info)
    if path is not None:
        write_atomic(path, data)
    return {"path": path, "step": state.step_index, "total_steps": state.total_steps, "bytes": len(data),
            "seconds": time.perf_counter() - started, **({"data": data} if path is None else {})}


def restore(fresh: StepRequestState, info: ModelInfo) -> StepRequestState:
    """``fresh`` (prepare_encode's state for the request, its block cache set) laid over with the checkpoint at
    ``fresh.request.resume_from``: the request continues at the saved step. InvalidRequestError naming
    ``resume_from`` when the file is not a checkpoint of this model and request, or its latents differ in shape."""
    path = fresh.request.resume_from
    try:
        with safe_open(path, "pt", device="cpu") as f:         # one open: the manifest and the tensors agree
            manifest = parse_manifest(f.metadata(), path)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except FileNotFoundError:
        raise InvalidRequestError(FIELD, path, "no such checkpoint file") from None
    except (OSError, ValueError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(FIELD, path, f"cannot read the checkpoint: {exc}") from None
    check_manifest(manifest, fresh.request, info)
    tree = manifest["state"]
    saved = tensors[tree["latents"]["tensor"]]
    if tuple(saved.shape) != tuple(fresh.latents.shape):
        raise InvalidRequestError(FIELD, path, f"the checkpoint's latents are {tuple(saved.shape)}; this request's "
                                               f"{tuple(fresh.latents.shape)}")
    device = fresh.latents.device
    for name, packed in tree.items():
        current = getattr(fresh, name)
        if name == "cache" and (current is None or packed is None):
            continue                   # the block cache as this stage runs it now: cold when it was off then
        setattr(fresh, name, unpack(current, packed, tensors, device, f"state.{name}"))
    return fresh
