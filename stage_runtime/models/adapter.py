"""PipelineAdapter: what the runner needs from a model, over a real diffusers pipeline.

An adapter declares what the model supports (request batching, step execution), loads the pipeline
from a local folder, validates a request against the model, and runs a fused batch of compatible
requests as ONE pipeline call with one generator per image. It never admits, batches, cancels or
routes requests: that is the scheduler's and the engine's job.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from diffusers.models.attention_processor import Attention

from stage_runtime.distributed import ulysses
from stage_runtime.errors import ConfigError
from stage_runtime.model_info import ModelInfo
from stage_runtime.models.refusals import Refusals, refusals_path
from stage_runtime.models.routed import RoutedDenoiser
from stage_runtime.request import DiffusionRequest

# a family's sequence-parallel hook: installer(denoiser, ulysses_degree, make_mesh), see PipelineAdapter.sequence_parallel
SequenceParallelInstaller = Callable[[torch.nn.Module, int, Callable], None]

diffusers_logging.disable_progress_bar()


@functools.cache
def call_parameters(pipeline_class: type) -> frozenset[str]:
    """The keyword parameters of a pipeline class's ``__call__``."""
    return frozenset(inspect.signature(pipeline_class.__call__).parameters)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


MIN_TILE_LATENTS = 4          # limits.decode_tile_side: the smallest tile a VAE decoder takes, in latents a side


class PipelineAdapter(Refusals, ABC):
    """A family's adapter over its loaded pipeline. Its refusals at admission (``check_request``) come from
    ``models.refusals``, torch-free, so the engine process runs them without importing this module.

    What a family provides (docs/adding-a-model-family.md): its facts (the class attributes below, with
    ``pipeline_classes`` and ``tiny_kinds`` read by ``stage_runtime.model_catalog``), ``run_batch`` (usually one
    ``call_pipeline``) and, for step mode, the step contract's ``prepare_encode`` / ``denoise_step``."""

    # The diffusers classes (model_index.json ``_class_name``) this adapter serves, and the make-tiny-model
    # kinds that build one: literals in the class body (model_catalog reads them without importing torch).
    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    tiny_kinds: ClassVar[tuple[str, ...]] = ()
    denoiser_name: ClassVar[str] = "transformer"      # the pipeline component called once per denoising step
    supports_request_batch: ClassVar[bool] = True
    supports_step_execution: ClassVar[bool] = False
    default_steps: ClassVar[int] = 20
    default_guidance: ClassVar[float] = 7.5
    # The family's facts (served in ModelInfo). parallel_kinds: what apply_parallelism may install through the
    # hooks below ("cfg", "ulysses", "ring", "tp"); guidance: how guidance_scale acts (see ModelInfo.guidance).
    parallel_kinds: ClassVar[frozenset[str]] = frozenset()
    guidance: ClassVar[str] = "cfg"
    cfg_above: ClassVar[float] = 1.0      # a "cfg" family runs its unconditional rows at guidance_scale above it
    # The denoiser's block lists in execution order, for layerwise offload (None: found by attribute name,
    # offload.plan.BLOCK_ATTRS).
    block_lists: ClassVar[tuple[str, ...] | None] = None
    # Regional compilation (stage_runtime.compilation): the denoiser's repeated block classes, when the model does
    # not declare them itself (diffusers' ``_repeated_blocks``, which wins).
    compile_blocks: ClassVar[tuple[str, ...]] = ()
    # The per-request block cache (models.block_cache) can skip this denoiser's blocks after the first.
    supports_block_cache: ClassVar[bool] = False
    # The block cache compares and carries only the first ``cache_tokens`` tokens of a block's output (None: all):
    # for a denoiser whose rows are padded to the longest row of the forward (Z-Image's [image ‖ caption]), the
    # image tokens, whose count does not depend on the batch-mates. Such an adapter sets it before each forward.
    cache_tokens: int | None = None
    # A block-cache family whose request mode runs the step contract's loop for the wave (``run_step_loop``): its
    # forwards' rows are laid out as in step mode, each request's together (models.block_cache.wave_rows).
    request_mode_step_loop: ClassVar[bool] = False
    # How an edit's strength gives its step count (ModelInfo.edit_step_rule): "int" or "flow" (FLUX).
    edit_step_rule: ClassVar[str] = "int"
    # The family only edits (its pipeline needs an image): a request without one is refused (ModelInfo.edits_only).
    edits_only: ClassVar[bool] = False
    # Pipeline components LoRA files may target (their key prefix, as diffusers' save_lora_weights writes);
    # () = this family serves no LoRA. A family that names any must set the rows of each of them
    # (``lora_rows``) around every call of that component (models/lora).
    lora_components: ClassVar[tuple[str, ...]] = ()
    # Modules of a LoRA component (component → module paths) whose input is the tokens of every image of a forward
    # concatenated into one sequence, not one row per image: a per-row adapter cannot be applied there, so a file
    # targeting one is refused at load, naming the key (Z-Image's patch and caption embedders).
    lora_flat_modules: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Loading: False materialises every weight (no meta tensors); None leaves it to diffusers, which needs it
    # on for a denoiser with modules kept in float32 (Wan's ``_keep_in_fp32_modules``).
    low_cpu_mem_usage: ClassVar[bool | None] = False
    # A prompt longer than the text encoder keeps (max_sequence_length) is a 400 at admission, not cut silently
    # as diffusers does (video families: minutes of compute on a truncated prompt). Counted by the engine with
    # the model's ``tokenizer/tokenizer.json`` (ModelInfo.prompt_tokenizer; engine/prompt_length.py).
    refuses_long_prompts: ClassVar[bool] = False
    loras = None          # the rank's LoraManager (models.lora.manager), set by the runner when loaded

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device):
        self.pipe = pipeline
        self.device = device
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def load(cls, path: str, device: torch.device, dtype: str = "float32", **components) -> "PipelineAdapter":
        """The pipeline in ``path`` on ``device``; ``components`` are modules already loaded (a GGUF denoiser,
        stage_runtime/quantization/gguf.py), passed to diffusers in place of the folder's: through the folder's own
        pipeline class, since DiffusionPipeline.from_pretrained loads a component the class declares optional
        (WanPipeline's transformer) from the folder even when one is passed."""
        loader = DiffusionPipeline
        if components:
            import diffusers

            loader = getattr(diffusers, DiffusionPipeline.load_config(path)["_class_name"])
        pipe = loader.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True,
                                      low_cpu_mem_usage=cls.low_cpu_mem_usage, **components)
        return cls(pipe.to(device), device)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.pipe.vae.config.block_out_channels) - 1)

    # -- what the model is -----------------------------------------------------------------------------
    @property
    def denoiser(self) -> torch.nn.Module:
        """The UNet / transformer: called exactly once per denoising step (CFG rows are fused)."""
        return getattr(self.pipe, self.denoiser_name)

    def block_holders(self) -> dict[str, torch.nn.Module]:
        """The pipeline components holding the denoiser's blocks, by name: the denoiser itself, or each part of a
        routed one (Wan 2.2's two experts, models.routed). Layerwise offload splits each into a head and its
        blocks; the block cache hooks each one's blocks."""
        denoiser = self.denoiser
        return denoiser.parts() if isinstance(denoiser, RoutedDenoiser) else {self.denoiser_name: denoiser}

    def default_size(self) -> tuple[int, int]:
        """(height, width) served when a request gives none: the denoiser's latent sample size, in pixels."""
        side = self.denoiser.config.sample_size * self.vae_scale_factor
        return side, side

    fixed_size: ClassVar[bool] = False
    # Compatibility keys (ModelInfo.request_key / step_key): the SamplingParams fields that must be equal to
    # share one pipeline call / one denoiser forward. None keeps ModelInfo's defaults.
    request_key_fields: ClassVar[tuple[str, ...] | None] = None
    step_key_fields: ClassVar[tuple[str, ...] | None] = None

    def size_multiple(self) -> int:
        return 8

    def info(self) -> ModelInfo:
        height, width = self.default_size()
        cls = type(self)
        return ModelInfo(
            pipeline_class=type(self.pipe).__name__, adapter=f"{cls.__module__}:{cls.__qualname__}",
            default_height=height, default_width=width, default_steps=self.default_steps,
            default_guidance=self.default_guidance, size_multiple=self.size_multiple(), fixed_size=self.fixed_size,
            supports_request_batch=self.supports_request_batch,
            supports_step_execution=self.supports_step_execution,
            num_attention_heads=self.num_attention_heads(), max_steps=self.max_steps(),
            parallel_kinds=tuple(sorted(self.parallel_kinds)), guidance=self.guidance,
            max_sequence_length=self.max_sequence_length(), edit_tasks=self.edit_tasks(),
            edit_step_rule=self.edit_step_rule, max_edit_images=self.max_edit_images(), edits_only=self.edits_only,
            lora_components=self.lora_components, refusals=refusals_path(cls),
            prompt_tokenizer=self.prompt_tokenizer_file() if self.refuses_long_prompts else None,
            **self.family_facts(),
            **{name: fields for name, fields in (("request_key", self.request_key_fields),
                                                 ("step_key", self.step_key_fields)) if fields is not None})

    def prompt_tokenizer_file(self) -> str | None:
        """The prompt tokenizer's ``tokenizer.json`` in the model folder (absolute), when it has one."""
        path = os.path.join(os.path.abspath(self.pipe.name_or_path or ""), "tokenizer", "tokenizer.json")
        return path if self.pipe.name_or_path and os.path.isfile(path) else None

    def bound_decode(self, tile_side: int) -> None:
        """Decode in spatial tiles of at most ``tile_side`` pixels a side (``limits.decode_tile_side``): the VAE's
        own tiling, tiles overlapping by a quarter and blended, so the decode's peak memory follows the tile,
        not the frame. A VAE whose tiling takes no tile size is a startup error naming the setting."""
        vae = getattr(self.pipe, "vae", None)
        params = inspect.signature(vae.enable_tiling).parameters if hasattr(vae, "enable_tiling") else {}
        if "tile_sample_min_height" not in params:
            raise ConfigError(f"limits.decode_tile_side={tile_side}: {type(self.pipe).__name__}'s VAE "
                              f"({type(vae).__name__}) has no tiled decode with a tile size")
        if tile_side < MIN_TILE_LATENTS * self.vae_scale_factor:     # the decoder's convolutions pad the tile
            raise ConfigError(f"limits.decode_tile_side={tile_side}: {type(self.pipe).__name__}'s VAE makes "
                              f"{self.vae_scale_factor} pixels of a latent a side; a tile takes at least "
                              f"{MIN_TILE_LATENTS} latents: {MIN_TILE_LATENTS * self.vae_scale_factor} or more")
        wanted = {"tile_sample_min_height": tile_side, "tile_sample_min_width": tile_side,
                  "tile_sample_stride_height": tile_side * 3 // 4, "tile_sample_stride_width": tile_side * 3 // 4,
                  "tile_latent_min_height": tile_side // self.vae_scale_factor,
                  "tile_latent_min_width": tile_side // self.vae_scale_factor, "tile_overlap_factor": 0.25}
        vae.enable_tiling(**{name: value for name, value in wanted.items() if name in params})

    def family_facts(self) -> dict:
        """More ModelInfo fields, read from the loaded pipeline, that this family's ``check_request`` needs
        (DiT: ``num_classes``, ``class_labels``); none by default."""
        return {}

    def edit_tasks(self) -> tuple[str, ...]:
        """What ``POST /v1/images/edits`` can run on this model ("img2img", "inpaint"); none by default."""
        return ()

    def max_edit_images(self) -> int:
        """Images one edit may upload (``image[]`` repeated); more are a 400 naming the first one too many."""
        return 1

    def max_sequence_length(self) -> int | None:
        """Text tokens the prompt encoder keeps (the tokenizer's limit); None without a tokenizer."""
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return None if tokenizer is None else int(tokenizer.model_max_length)

    def max_steps(self) -> int | None:
        """Most denoising steps the noise scheduler can place: its training timesteps less the offset its
        timesteps are shifted by (DDIM with ``steps_offset=1`` and 1000 steps would index timestep 1000)."""
        config = self.pipe.scheduler.config
        train = config.get("num_train_timesteps")
        return None if train is None else int(train) - int(config.get("steps_offset", 0) or 0)

    def num_attention_heads(self) -> int:
        """The head count every attention layer of the denoiser is divisible by (gcd over layers); a family whose
        attention is not diffusers' ``Attention`` (FLUX's, Wan's) counts its own."""
        heads = [m.heads for m in self.denoiser.modules() if isinstance(m, Attention)]
        return math.gcd(*heads) if heads else 1

    # -- parallel hooks (called once after loading, only for kinds in ``parallel_kinds``) -----------------
    def parallel_refusal(self, kind: str) -> str | None:
        """Why this family cannot run ``kind`` parallelism (said in the startup error), or None."""
        return None

    def enable_cfg_parallel(self, group) -> None:
        """Split the rows of every denoiser call across ``group`` (the CFG halves, then requests)."""
        from stage_runtime.distributed.cfg_parallel import enable_cfg_parallel

        enable_cfg_parallel(self.denoiser, group, around_local=self.rows_on_this_rank(self.denoiser))

    def rows_on_this_rank(self, module: torch.nn.Module):
        """For a wrapper that runs a call of ``module`` on some of its rows only (a CFG-parallel rank's chunk): the
        context factory (row indices → context) under which the call's LoRA row plans follow those rows."""
        def scope(rows: torch.Tensor):
            if self.loras is None:
                return contextlib.nullcontext()
            if isinstance(module, RoutedDenoiser):       # each part's plan is made inside, from the rows it gets
                return module.local_rows(rows)
            return self.loras.subset(module, rows)
        return scope

    # The family's sequence-parallel hook: the installer Ulysses and ring (and both) go through, called as
    # ``installer(denoiser, ulysses_degree, make_mesh)``; it validates the whole denoiser, then shards its token
    # sequence over the mesh ``make_mesh()`` builds (a distributed.usp.SequenceMesh). The default is the skeleton for
    # the self-attention of diffusers' BasicTransformerBlock stacks (UNet, DiT); an MMDiT's joint text+image
    # attention (SD3, FLUX.1) names distributed.ulysses_joint's; a family with an attention of its own (Qwen-Image,
    # Z-Image, FLUX.2, HunyuanVideo-1.5, Wan) defines its installer in its own module (models/families/).
    sequence_parallel: ClassVar[SequenceParallelInstaller] = staticmethod(ulysses.enable_sequence_parallel)

    def enable_ulysses(self, group, degree: int) -> None:
        """Shard the denoiser's token sequence across ``group``; attention trades tokens for heads."""
        from stage_runtime.distributed.usp import SequenceMesh

        if degree > 1:
            self.enable_sequence_parallel(degree, lambda: SequenceMesh.ulysses(group, degree))

    def enable_sequence_parallel(self, ulysses_degree: int, make_mesh) -> None:
        """Ulysses × ring over the mesh ``make_mesh()`` returns (a distributed.usp.SequenceMesh), by the family's
        ``sequence_parallel`` installer."""
        if hasattr(self, "sequence_attention"):        # an adapter written before the hook: never guess its attention
            raise ConfigError(f"{type(self).__name__}.sequence_attention={self.sequence_attention!r} is no longer read: "
                              "declare the installer itself, sequence_parallel = staticmethod(installer) "
                              "(docs/adding-a-model-family.md)")
        if not callable(self.sequence_parallel):
            raise ConfigError(f"{type(self).__name__}.sequence_parallel={self.sequence_parallel!r} is not an installer "
                              "(denoiser, ulysses_degree, make_mesh)")
        self.sequence_parallel(self.denoiser, ulysses_degree, make_mesh)

    def enable_tensor_parallel(self, group, degree: int) -> None:
        """Split the heads and MLP hidden units of the denoiser's blocks across ``group`` (weights sharded)."""
        from stage_runtime.distributed.tensor_parallel import enable_tensor_parallel

        enable_tensor_parallel(self.denoiser, group, degree)

    # -- serving ---------------------------------------------------------------------------------------
    @abstractmethod
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        """One pipeline call for key-compatible requests → uint8 images (n, H, W, 3) by request id."""

    def lora_rows(self, component: str, requests: list[tuple[DiffusionRequest, int]], repeat: int = 1):
        """Context for ONE fused call of ``component``: row by row, whose adapters (request, its row count;
        the whole list ``repeat`` times, e.g. 2 for [uncond; cond] CFG rows). A no-op without LoRA."""
        if self.loras is None:
            return contextlib.nullcontext()
        rows = [r.sampling.loras for r, n in requests for _ in range(n)]
        return self.loras.rows(component, rows * repeat)

    @contextlib.contextmanager
    def batch_lora_rows(self, requests: list[DiffusionRequest], cfg_rows: int = 1,
                        components: tuple[str, ...] | None = None):
        """Context for one fused call over ``requests``: every LoRA component (or ``components``) gets one
        row per image; the denoiser's rows repeat ``cfg_rows`` times ([uncond; cond] under CFG)."""
        rows = [(r, r.sampling.num_outputs) for r in requests]
        with contextlib.ExitStack() as stack:
            for component in self.lora_components if components is None else components:
                repeat = cfg_rows if component == self.denoiser_name else 1
                stack.enter_context(self.lora_rows(component, rows, repeat=repeat))
            yield

    @property
    def encoder_lora_components(self) -> tuple[str, ...]:
        """The LoRA components called once per prompt (the text encoders), not per step (nor Wan 2.2's second
        expert: every component a routed denoiser is made of is a denoiser)."""
        denoiser = self.denoiser
        denoising = {self.denoiser_name, *(denoiser.part_names if isinstance(denoiser, RoutedDenoiser) else ())}
        return tuple(c for c in self.lora_components if c not in denoising)

    def call_pipeline(self, requests: list[DiffusionRequest], pipe: DiffusionPipeline | None = None,
                      generators: list[torch.Generator] | None = None, **family_kw) -> dict[str, np.ndarray]:
        """ONE call of ``pipe`` (the family's pipeline by default) for key-compatible requests → uint8 images by
        request id. Fills what every family passes, where ``__call__`` takes it: the shared size, steps and
        guidance, one generator per image (``generators``, when the family drew from them already),
        ``output_type="np"``; ``family_kw`` adds the family's own (prompts or embeddings, image, strength, …)."""
        pipe = self.pipe if pipe is None else pipe
        s = requests[0].sampling                      # key-compatible: size, steps and guidance are shared
        shared = {"height": s.height, "width": s.width, "num_inference_steps": s.num_inference_steps,
                  "guidance_scale": s.guidance_scale}
        accepted = call_parameters(type(pipe))
        kwargs = {name: value for name, value in shared.items() if name in accepted}
        generators = self.generators(requests) if generators is None else generators
        kwargs.update(family_kw, generator=generators, output_type="np", return_dict=False)
        return self.split_images(requests, pipe(**kwargs)[0])

    @staticmethod
    def image_rows(requests: list[DiffusionRequest]) -> list[DiffusionRequest]:
        """Each request once per image it asks for, in request order: the rows of a fused call."""
        return [r for r in requests for _ in range(r.sampling.num_outputs)]

    @classmethod
    def prompt_kwargs(cls, requests: list[DiffusionRequest], negative: bool = True) -> dict[str, list[str]]:
        """``prompt`` (and ``negative_prompt``, "" when none) per image row."""
        rows = cls.image_rows(requests)
        kwargs = {"prompt": [r.prompt for r in rows]}
        if negative:
            kwargs["negative_prompt"] = [r.sampling.negative_prompt or "" for r in rows]
        return kwargs

    # -- helpers for subclasses -------------------------------------------------------------------------
    @staticmethod
    def generators(requests: list[DiffusionRequest]) -> list[torch.Generator]:
        """One CPU generator per image, seeded seed+i: a request's images do not depend on its batch-mates."""
        return [torch.Generator("cpu").manual_seed(r.sampling.seed + i)
                for r in requests for i in range(r.sampling.num_outputs)]

    @staticmethod
    def to_uint8(images: np.ndarray) -> np.ndarray:
        """Float images in [0, 1] → uint8, rounded as diffusers' ``numpy_to_pil`` does."""
        return (np.asarray(images) * 255).round().clip(0, 255).astype(np.uint8)

    @classmethod
    def split_images(cls, requests: list[DiffusionRequest], images: np.ndarray) -> dict[str, np.ndarray]:
        """Slice fused float images in [0, 1] back per request (rows are in request order)."""
        pixels = cls.to_uint8(images)
        out, row = {}, 0
        for r in requests:
            n = r.sampling.num_outputs
            out[r.request_id] = pixels[row:row + n]
            row += n
        if row != len(pixels):
            raise RuntimeError(f"pipeline returned {len(pixels)} images for {row} requested")
        return out
