"""The generic adapter: any diffusers pipeline without a dedicated adapter, served in request mode.

The pipeline is a black box. A request becomes one ``__call__`` with the request's fields that the
call's signature accepts (prompt, negative prompt, size, steps, guidance, per-image generators,
``num_images_per_prompt``). What the adapter cannot do is said once at load (see :meth:`features`):

    step mode, CFG-parallel, Ulysses      never (asking for them exits 2, naming the pipeline class)
    progress + abort at each step         through ``callback_on_step_end`` when ``__call__`` has it;
                                          otherwise no progress and abort only before the call starts
    fused batches of requests             only when ``prompt`` and ``generator`` accept lists
    a request field ``__call__`` lacks    refused at admission, never dropped (models.refusals.
                                          GenericRefusals): a negative prompt, a guidance scale or a step
                                          count other than the default, n > 1 without lists or
                                          ``num_images_per_prompt``; without height and width in the call,
                                          its default size only (``fixed_size``)

Step clock: the runner marks denoising steps with a forward pre-hook on ``adapter.denoiser`` (it
reports progress and unwinds the call when every request of it was aborted). A black box has no
denoiser we can count on (a pipeline may call its UNet twice per step, or not at all), so the
generic adapter's ``denoiser`` is a :class:`StepClock` — a module without weights that the adapter
calls once before the pipeline starts and once at the end of every denoising step but the last,
from ``callback_on_step_end``. Each call is one runner step boundary.
"""

from __future__ import annotations

import inspect
import logging
import typing

import numpy as np
import torch

from stage_runtime.errors import ModelLoadError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.refusals import GenericRefusals
from stage_runtime.request import DiffusionRequest

log = logging.getLogger(__name__)
# The __call__ parameters a request's fields go to (ModelInfo.call_params: those the pipeline has).
REQUEST_PARAMS = ("prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale",
                  "num_images_per_prompt")


class StepClock(torch.nn.Module):
    """A weightless module called once per step boundary (the runner's pre-hook counts its calls)."""

    def forward(self, step_index: int) -> int:
        return step_index


def _accepts_list(parameter: inspect.Parameter | None) -> bool:
    """Whether a ``__call__`` parameter's annotation admits a list (``str | list[str]``, ``List[...]``)."""
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return False
    annotation = parameter.annotation
    text = annotation if isinstance(annotation, str) else repr(annotation)
    if "list" in text.lower():
        return True
    return any(typing.get_origin(arg) is list for arg in typing.get_args(annotation))


class GenericDiffusersAdapter(GenericRefusals, PipelineAdapter):
    supports_step_execution = False
    parallel_kinds = frozenset()
    guidance = "cfg"

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.params = inspect.signature(type(pipeline).__call__).parameters
        self.clock = StepClock()
        self.has_step_callback = "callback_on_step_end" in self.params
        # Fused batches need one prompt and one generator per image.
        self.supports_request_batch = _accepts_list(self.params.get("prompt")) and _accepts_list(
            self.params.get("generator"))
        self.default_steps = self._default("num_inference_steps", PipelineAdapter.default_steps)
        fallback = PipelineAdapter.default_guidance if "guidance_scale" in self.params else 1.0
        self.default_guidance = float(self._default("guidance_scale", fallback))
        self.fixed_size = not {"height", "width"} <= set(self.params)      # the call picks its own size
        log.warning("%s", self.features())

    @classmethod
    def load(cls, path: str, device: torch.device, dtype: str = "float32", **components) -> "GenericDiffusersAdapter":
        import diffusers

        from stage_runtime.models.registry import read_pipeline_class

        name = read_pipeline_class(path)
        if not isinstance(getattr(diffusers, name, None), type):
            raise ModelLoadError(f"model.path={path!r}: pipeline class {name!r} is neither served by a dedicated "
                                 f"adapter nor a diffusers pipeline class (diffusers {diffusers.__version__})")
        return super().load(path, device, dtype, **components)

    def _default(self, name: str, fallback):
        parameter = self.params.get(name)
        if parameter is None or parameter.default in (inspect.Parameter.empty, None):
            return fallback
        return parameter.default

    # -- what the model is -----------------------------------------------------------------------------
    @property
    def denoiser(self) -> torch.nn.Module:
        return self.clock

    def _sample_size(self) -> int | None:
        for name in ("unet", "transformer"):
            config = getattr(getattr(self.pipe, name, None), "config", None)
            size = getattr(config, "sample_size", None) if config is not None else None
            if isinstance(size, int):
                return size
        return None

    def size_multiple(self) -> int:
        factor = getattr(self.pipe, "vae_scale_factor", None)
        return int(factor) if isinstance(factor, int) and factor > 0 else 8

    def default_size(self) -> tuple[int, int]:
        size = self._sample_size()
        side = size * self.size_multiple() if size else 512
        return side, side

    def num_attention_heads(self) -> int:
        return 1            # no sequence parallelism: nothing is split by heads

    def parallel_refusal(self, kind: str) -> str | None:
        return (f"{type(self.pipe).__name__} has no dedicated adapter; the generic diffusers adapter runs it as "
                "a black box in request mode (no step mode, no CFG-parallel, no Ulysses)")

    def features(self) -> str:
        """What this pipeline gets from the generic adapter, said once at startup."""
        name = type(self.pipe).__name__
        steps = ("progress and abort at every step through callback_on_step_end" if self.has_step_callback else
                 "no callback_on_step_end: no progress events, abort only before the pipeline call starts")
        batch = ("compatible requests fused into one call" if self.supports_request_batch else
                 "one request per call (prompt/generator take no lists)")
        return (f"{name} is served by the generic diffusers adapter: request mode only (no step mode, "
                f"no CFG-parallel, no Ulysses); {steps}; {batch}")

    def family_facts(self) -> dict:
        return {"call_params": tuple(name for name in REQUEST_PARAMS if name in self.params)}

    # -- serving ---------------------------------------------------------------------------------------
    def call_kwargs(self, requests: list[DiffusionRequest]) -> dict:
        """The ``__call__`` keyword arguments for a key-compatible group (only those the signature has)."""
        s = requests[0].sampling
        gens = self.generators(requests)
        if self.supports_request_batch:
            prompts = [r.prompt for r in requests for _ in range(r.sampling.num_outputs)]
            negatives = [r.sampling.negative_prompt or "" for r in requests for _ in range(r.sampling.num_outputs)]
            per_prompt, generator = 1, gens
        else:                 # one request: its prompt once, its images from the prompt's count
            prompts, negatives = requests[0].prompt, s.negative_prompt or ""
            per_prompt = s.num_outputs
            generator = gens if _accepts_list(self.params.get("generator")) else gens[0]
        wanted = {"prompt": prompts, "negative_prompt": negatives, "height": s.height, "width": s.width,
                  "num_inference_steps": s.num_inference_steps, "guidance_scale": s.guidance_scale,
                  "generator": generator, "num_images_per_prompt": per_prompt, "output_type": "np",
                  "return_dict": False}
        kwargs = {k: v for k, v in wanted.items() if k in self.params}
        if self.has_step_callback:
            kwargs["callback_on_step_end"] = self._on_step_end(s.num_inference_steps)
        return kwargs

    def _on_step_end(self, num_steps: int):
        def callback(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
            if step + 1 < num_steps:        # the last step's boundary is the result itself
                self.clock(step + 1)
            return {}

        return callback

    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        kwargs = self.call_kwargs(requests)
        self.clock(0)                       # the step boundary before the call (an abort lands here)
        out = self.pipe(**kwargs)
        images = out[0] if isinstance(out, tuple) else getattr(out, "images", out)
        if isinstance(images, list):        # a pipeline that ignored output_type="np" (PIL images)
            images = np.stack([np.asarray(image, dtype=np.float32) / 255.0 for image in images])
        return self.split_images(requests, np.asarray(images))
