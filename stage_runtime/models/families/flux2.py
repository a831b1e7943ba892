"""FLUX.2 pipelines: ``Flux2Pipeline`` (FLUX.2 [dev]) here, ``Flux2KleinPipeline`` in ``models/families/flux2_klein.py``; both
over the same ``Flux2Transformer2DModel``, VAE and scheduler, so the step math they share is ``Flux2Base``.

What FLUX.2 does differently from FLUX.1 (``models/families/flux.py``), as diffusers 0.42.1 runs it:

    prompt      one text encoder (Mistral 3 for [dev], Qwen3 for Klein) in a chat template, padded to 512 tokens;
                the hidden states of three layers stacked per token ((10, 20, 30) / (9, 18, 27)): no pooled vector
    latents     the VAE's latents patchified 2x2 then flattened (n, h/2 · w/2, 4C); 4-axis position ids (t, h, w, l)
                for image and text tokens (the transformer reads the first row's)
    schedule    sigmas 1 → 1/steps, shifted by FLUX.2's empirical ``mu`` (image tokens AND step count)
    decode      tokens scattered back by their ids, un-normalised by the VAE's batch-norm statistics
                (z · sqrt(var + eps) + mean), un-patchified, decoded
    transformer 4-axis rotary over [text ‖ image]; double-stream blocks, then single-stream blocks over the joint
                [text ‖ image] tokens (fused q/k/v + MLP projections)

FLUX.2 [dev] is guidance-distilled like FLUX.1 [dev]: ``guidance_scale`` is an embedding per row, one pass, no
negative prompt (diffusers' ``Flux2Pipeline`` takes none), hence no CFG parallel. A step is ONE transformer forward
over every request's rows; requests of different step counts and guidance scales share it (one size: one set of
position ids). Request mode runs the same step loop for the wave (equal to ``Flux2Pipeline.__call__`` within 1
uint8 on the tiny model), not diffusers' call: its decode reads the VAE's batch-norm statistics outside any forward, which
layerwise offload would not have brought in (``post_decode`` does, with a forward of the batch-norm on no rows).

Ulysses and ring shard both token streams of every block (the installer below); tensor parallel is
refused (``distributed/tensor_parallel.py`` does not shard the single-stream blocks' fused ``to_qkv_mlp_proj``). The
block cache skips the blocks after the first double-stream block per request (``models/block_cache.py`` reads the
last single-stream block's image tokens out of its joint output).

Reference images (the pipeline's ``image``: multi-reference editing) come through ``/v1/images/edits`` (``image[]``
repeated, at most ``MAX_REFERENCES``): each is resized, cropped and VAE-encoded as ``__call__`` does, and every
forward's rows carry [image tokens ‖ each reference's tokens] with the references' position ids (time coordinate
10·(i + 1)); the output keeps the image tokens. The references' sizes are in both compatibility keys (they set the
sequence), so a forward never mixes sizes; without a size the image takes the first reference's (rounded down to
16), as ``__call__`` does for references up to 1024² pixels. LoRA adapts the transformer, as ``Flux2LoraLoaderMixin`` (the text encoders never):
every forward runs inside ``lora_rows("transformer")`` with its rows (a guided Klein request's twice), in both modes.

Ulysses / ring sequence parallelism over FLUX.2's joint text+image sequence (Flux2Transformer2DModel: FLUX.2
[dev] and [klein]).

Like FLUX.1 (distributed/ulysses_joint.py, whose split rule this reuses), both token streams are cut across the P
ranks of the sequence-parallel group and every attention runs over all tokens; what differs is FLUX.2's attention
modules and how its transformer joins and drops the text::

    transformer_blocks[0] pre-hook   image (B, S_i, C) → my chunk; text (B, S_t, C) → my chunk; the rotary table
                                     over [text ‖ image] → the rows of my text then my image tokens (every block)
    double-stream attention          Flux2UlyssesProcessor: q/k/v of [my text ‖ my image], RMS-normed per head,
    (Flux2Attention)                 rotary → mesh attention (all tokens, H/P heads) → to_add_out / to_out
    the transformer                  joins the streams itself: [my text ‖ my image] is one rank's single-stream input
    single-stream attention          Flux2UlyssesSingleProcessor: the fused to_qkv_mlp_proj on my tokens, the q/k/v
    (Flux2ParallelSelfAttention)     part through the mesh, the MLP part local, to_out over [attention ‖ MLP]
    last single block forward hook   the transformer drops the first S_t (its whole text length) tokens: my t_r text
                                     tokens are padded to S_t so what it keeps is exactly my image tokens
    proj_out forward hook            my image tokens → all_gather → (B, S_i, c) on every rank

Chunks may be uneven; a stream with fewer tokens than ranks runs unsharded (the same decision on every rank).
The heads must divide by the Ulysses degree. Only diffusers' default processors are replaced (the KV-cache
processors of Flux2KleinKV are refused); a processor replaced after install makes the next call raise.
"""

from __future__ import annotations

import copy
import numpy as np
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from PIL import Image

from stage_runtime.distributed import sequence_shard
from stage_runtime.distributed.sequence_shard import ShardState, Sharded, check_ulysses_heads
from stage_runtime.distributed.ulysses_joint import joint_attention_heads, split_joint
from stage_runtime.distributed.usp import SequenceMesh
from stage_runtime.errors import ConfigError
from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.refusals import Flux2Refusals
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.request import DiffusionRequest

MAX_SEQUENCE_LENGTH = 512          # both pipelines' max_sequence_length default (prompts padded to it)
MAX_REFERENCES = 10                # reference images one request may give (BFL: up to 10 for FLUX.2 [dev])
REFERENCE_AREA = 1024 * 1024       # __call__ resizes a larger reference image to this many pixels


# -- sequence parallelism: the installer of the adapter's ``sequence_parallel`` (see the module docstring) ------------
_DEFAULT_PROCESSORS = ("Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor")


def _heads(attn, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unflatten(-1, (-1, attn.head_dim))


class _Processor:
    """Shared by both kinds: the original processor for unsharded calls, the mesh and the shard plan otherwise."""

    def __init__(self, mesh: SequenceMesh, state: ShardState, original):
        self.mesh, self.state, self.original = mesh, state, original

    def attend(self, query, key, value, rotary, local_tokens: int) -> torch.Tensor:
        """Rotary on my tokens, attention over every rank's → (B, local, H · D)."""
        if rotary is not None:
            query = apply_rotary_emb(query, rotary, sequence_dim=1)
            key = apply_rotary_emb(key, rotary, sequence_dim=1)
        shard = self.state.shard
        counts = [i + t for i, t in zip(shard.image, shard.text, strict=True)]
        if counts[self.mesh.sp_rank] != local_tokens:
            raise RuntimeError(f"FLUX.2 Ulysses: {local_tokens} local tokens do not match the shard plan {counts}")
        return self.mesh.attention(query, key, value, counts).flatten(2, 3).to(query.dtype)


class Flux2UlyssesProcessor(_Processor):
    """A double-stream block's Flux2Attention over [text ‖ image]."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if self.state.shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                 **kwargs)
        if attention_mask is not None or encoder_hidden_states is None:
            raise RuntimeError("FLUX.2 Ulysses: a double-stream attention got a mask or no text stream")
        image = [_heads(attn, p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        text = [_heads(attn, p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        image[0], image[1] = attn.norm_q(image[0]), attn.norm_k(image[1])
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        query, key, value = (torch.cat([t, i], dim=1) for t, i in zip(text, image, strict=True))
        out = self.attend(query, key, value, image_rotary_emb, query.shape[1])
        text_len = encoder_hidden_states.shape[1]
        context, image_out = out[:, :text_len], out[:, text_len:]
        return attn.to_out[1](attn.to_out[0](image_out.contiguous())), attn.to_add_out(context.contiguous())


class Flux2UlyssesSingleProcessor(_Processor):
    """A single-stream block's Flux2ParallelSelfAttention over the joint [text ‖ image] tokens."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None, **kwargs):
        if self.state.shard is None:
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb, **kwargs)
        if attention_mask is not None:
            raise RuntimeError("FLUX.2 Ulysses: a single-stream attention got an attention mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = projected.split([3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim], dim=-1)
        query, key, value = (_heads(attn, t) for t in qkv.chunk(3, dim=-1))
        out = self.attend(attn.norm_q(query), attn.norm_k(key), value, image_rotary_emb, hidden_states.shape[1])
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def _check_attention(name: str, attn, degree: int) -> None:
    kind = type(attn.processor).__name__
    if kind not in _DEFAULT_PROCESSORS:
        raise ConfigError(f"Ulysses: {name} uses {kind}; FLUX.2 sequence parallelism replaces only "
                          f"{', '.join(_DEFAULT_PROCESSORS)} (the KV-cache processors are not sharded)")
    if getattr(attn, "fused_projections", False):
        raise ConfigError(f"Ulysses: {name} has fused q/k/v projections, which FLUX.2 Ulysses does not implement")
    check_ulysses_heads(attn.heads, degree)


def enable_flux2_sequence_parallel(transformer: torch.nn.Module, ulysses_degree: int, make_mesh) -> None:
    """Shard a Flux2Transformer2DModel's joint sequence across the mesh ``make_mesh()`` builds once everything is
    validated (ConfigError: heads not divisible by ``ulysses_degree``, another processor, a wrong group)."""
    sequence_shard.install(transformer, make_mesh, lambda: [_plan(transformer, ulysses_degree)])


def _plan(transformer: torch.nn.Module, degree: int) -> Sharded:
    name = type(transformer).__name__
    double, single = (list(getattr(transformer, n, ())) for n in ("transformer_blocks", "single_transformer_blocks"))
    if not double or not single or not hasattr(transformer, "proj_out"):
        raise ConfigError(f"Ulysses: {name} has no FLUX.2 double- and single-stream blocks to shard")
    attentions = [(f"{name}.{n}", m) for n, m in transformer.named_modules() if n.endswith(".attn")]
    for attn_name, attn in attentions:
        _check_attention(attn_name, attn, degree)
    plan = _Flux2Plan(single[-1])
    return Sharded(name, [*double, *single], transformer.proj_out, [attn for _, attn in attentions], plan.processor,
                   plan.split)


class _Flux2Plan:
    """The split rule (FLUX.1's: both streams, my rotary rows), the processors, and the last single-stream block's
    hook that pads my text tokens to the whole text length (installed with the processors, after validation)."""

    def __init__(self, last_block: torch.nn.Module):
        self.last_block, self.hooked = last_block, False
        self.shard, self.rank = None, 0

    def split(self, mesh: SequenceMesh, args: tuple, kwargs: dict):
        self.shard, self.rank = split_joint(mesh, args, kwargs), mesh.sp_rank
        return self.shard

    def keep_my_image(self, _module, _args, output: torch.Tensor):
        """[my text ‖ my image] → [zeros up to the whole text length ‖ my text ‖ my image]: the transformer's
        ``hidden_states[:, num_txt_tokens:]`` then keeps exactly my image tokens."""
        shard, self.shard = self.shard, None
        if shard is None:
            return None
        missing = sum(shard.text) - shard.text[self.rank]
        return torch.cat([output.new_zeros((output.shape[0], missing, output.shape[2])), output], dim=1)

    def processor(self, mesh: SequenceMesh, state: ShardState, attn) -> _Processor:
        if not self.hooked:
            self.last_block.register_forward_hook(self.keep_my_image)
            self.hooked = True
        single = type(attn.processor).__name__ == "Flux2ParallelSelfAttnProcessor"
        return (Flux2UlyssesSingleProcessor if single else Flux2UlyssesProcessor)(mesh, state, attn.processor)


# -- the family -------------------------------------------------------------------------------------------------------
def flux2_scheduler(scheduler, num_steps: int, device: torch.device, image_seq_len: int):
    """A private copy of ``scheduler`` with the timesteps FLUX.2's ``__call__`` sets, positioned at step 0."""
    own = copy.deepcopy(scheduler)
    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)
    if own.config.get("use_flow_sigmas", False):
        own.set_timesteps(num_steps, device=device, mu=mu)
    else:
        own.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device=device, mu=mu)
    own.set_begin_index(0)
    return own


class Flux2Base(Flux2Refusals, StepContract, PipelineAdapter):
    """What Flux2Pipeline and Flux2KleinPipeline share: encode, latents, schedule, the forward, the decode."""

    default_steps = 50
    default_guidance = 4.0                                          # both __call__ defaults
    sequence_parallel = staticmethod(enable_flux2_sequence_parallel)     # both streams, both block kinds (above)
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    supports_block_cache = True
    # the reference images' sizes give the sequence ([image tokens ‖ each reference's tokens]): in both keys
    request_key_fields = ("height", "width", "num_inference_steps", "guidance_scale", "edit_shapes")
    step_key_fields = ("height", "width", "edit_shapes")            # timesteps and guidance are per row
    lora_components = ("transformer",)                              # as Flux2LoraLoaderMixin (no text encoder)

    def edit_tasks(self) -> tuple[str, ...]:
        return ("instruct",)                   # reference images: the prompt says what to make of them

    def max_edit_images(self) -> int:
        return MAX_REFERENCES

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2                            # the VAE's factor, then 2x2 patches

    def default_size(self) -> tuple[int, int]:
        side = self.pipe.default_sample_size * self.vae_scale_factor  # what __call__ makes without a size
        return side, side

    def max_sequence_length(self) -> int:
        return MAX_SEQUENCE_LENGTH

    def num_attention_heads(self) -> int:
        return joint_attention_heads(self.denoiser)

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "tp":
            return ("distributed/tensor_parallel.py does not shard FLUX.2's attention (Flux2Attention) nor the "
                    "single-stream blocks' fused q/k/v + MLP projection (to_qkv_mlp_proj)")
        return None

    # -- the step contract's shared parts ------------------------------------------------------------------
    def encode(self, text: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, 512, D) embeddings of ``text`` for n images and their (n, 512, 4) position ids."""
        return self.pipe.encode_prompt(prompt=[text], device=self.device, num_images_per_prompt=n,
                                       max_sequence_length=MAX_SEQUENCE_LENGTH)

    def new_state(self, request: DiffusionRequest) -> StepRequestState:
        """The prompt encoded (with the request's encoder LoRA rows), latents from its generators, its schedule."""
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        with self.batch_lora_rows([request], components=self.encoder_lora_components):
            embeds, text_ids = self.encode(request.prompt, n)
        latents, image_ids = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, s.height, s.width,
                                                  embeds.dtype, self.device, self.generators([request]))
        scheduler = flux2_scheduler(pipe.scheduler, s.num_inference_steps, self.device, latents.shape[1])
        cond = {"embeds": embeds, "text_ids": text_ids, "image_ids": image_ids}
        if request.edit is not None:
            cond["ref_latents"], cond["ref_ids"] = self.references(request, n)
        return StepRequestState(request, scheduler, latents, do_cfg=False, cond=cond)

    def references(self, request: DiffusionRequest, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's reference images as ``__call__`` conditions on them: each above 1024² pixels resized to that
        area, cropped to a multiple of 16, VAE-encoded (the mode), patchified, batch-norm normalised and packed; every
        reference's tokens one after the other, at time coordinate 10·(i + 1) of the position ids; (n, R, C), (n, R,
        4)."""
        pipe, processor, multiple = self.pipe, self.pipe.image_processor, self.vae_scale_factor * 2
        images = []
        for picture in request.edit.images:
            image = Image.fromarray(picture, mode="RGB")
            if image.width * image.height > REFERENCE_AREA:
                image = processor._resize_to_target_area(image, REFERENCE_AREA)
            width, height = image.width // multiple * multiple, image.height // multiple * multiple
            images.append(processor.preprocess(image, height=height, width=width, resize_mode="crop"))
        latents, ids = pipe.prepare_image_latents(images=images, batch_size=n, generator=None, device=self.device,
                                                  dtype=pipe.vae.dtype)
        return latents, ids

    @staticmethod
    def with_references(state: StepRequestState, latents: torch.Tensor) -> torch.Tensor:
        """A row group's transformer input: its latents, then its references' tokens (a generation: the latents)."""
        refs = state.cond.get("ref_latents")
        return latents if refs is None else torch.cat([latents, refs[:len(latents)].to(latents.dtype)], dim=1)

    def forward(self, states: list[StepRequestState], rows: list[tuple[StepRequestState, torch.Tensor, torch.Tensor]],
                guidance: torch.Tensor | None = None) -> torch.Tensor:
        """ONE transformer forward over ``rows`` ((state, latents, text embeddings) in row order), each at its
        state's timestep; the position ids are the first state's (one size, one text length per forward)."""
        hidden = torch.cat([self.with_references(st, latents) for st, latents, _ in rows])
        timesteps = torch.cat([st.timestep.expand(len(latents)).to(latents.dtype) for st, latents, _ in rows])
        first = states[0].cond                   # one size and one set of reference sizes per forward (the keys)
        ids = first["image_ids"] if "ref_ids" not in first else torch.cat([first["image_ids"], first["ref_ids"]], 1)
        with self.lora_rows("transformer", [(st.request, len(latents)) for st, latents, _ in rows]):
            out = self.pipe.transformer(
                hidden_states=hidden.to(self.pipe.transformer.dtype), timestep=timesteps / 1000, guidance=guidance,
                encoder_hidden_states=torch.cat([embeds for _, _, embeds in rows]),
                txt_ids=first["text_ids"][0], img_ids=ids[0], joint_attention_kwargs=None, return_dict=False)[0]
        return out[:, :states[0].latents.shape[1]]                # the image tokens; the references' are dropped

    def post_decode(self, state: StepRequestState) -> np.ndarray:
        """Tokens back to (n, 4C, h/2, w/2) by their ids, the batch-norm undone, un-patchified, decoded."""
        pipe = self.pipe
        latents = pipe._unpack_latents_with_ids(state.latents, state.cond["image_ids"])
        bn = pipe.vae.bn
        bn(latents[:0].to(pipe.vae.dtype))      # no rows: under offload its pre-hook makes the VAE (its buffers) resident
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(latents.device,
                                                                                                latents.dtype)
        latents = pipe._unpatchify_latents(latents * std + mean)
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        return self.to_uint8(pipe.image_processor.postprocess(image, output_type="np"))


class Flux2Adapter(Flux2Base):
    pipeline_classes = ("Flux2Pipeline",)
    tiny_kinds = ("flux2",)
    guidance = "distilled"                       # a guidance embedding per row; no negative prompt
    parallel_kinds = frozenset({"ulysses", "ring"})

    def parallel_refusal(self, kind: str) -> str | None:
        if kind == "cfg":
            return ("FLUX.2 [dev] is guidance-distilled: guidance_scale is an embedding inside the single "
                    "transformer pass of each step, there is no unconditional pass to put on another rank")
        return super().parallel_refusal(kind)

    # -- request mode: the step loop, to the end, for the whole wave (one row per image, in request order) ------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract ---------------------------------------------------------------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> StepRequestState:
        state = self.new_state(request)
        n = request.sampling.num_outputs
        state.cond["guidance"] = torch.full([n], request.sampling.guidance_scale, device=self.device,
                                            dtype=torch.float32)
        return state

    def denoise_step(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        rows = [(st, st.latents, st.cond["embeds"]) for st in states]
        noise = self.forward(states, rows, guidance=torch.cat([st.cond["guidance"] for st in states]))
        return self.split_rows(noise, [st.latents for st in states])
