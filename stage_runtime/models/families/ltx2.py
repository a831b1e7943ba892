"""LTX-2 text-to-video with sound (LTX2Pipeline): one transformer denoises video and audio latents together.

A step of ``LTX2Pipeline.__call__`` (diffusers 0.42.1) runs the transformer up to three times per request: the
CFG pair ``[uncond; cond]`` (negative prompt, prompt), a spatio-temporal-guidance (STG) pass with the self-attention
of ``spatio_temporal_guidance_blocks`` replaced by its values, and a modality-isolation pass with the audio-to-video
and video-to-audio cross-attention off. Each pass predicts a velocity for both the video and the audio latents;
the guided prediction is formed on x0 (``x0 = latents - sigma x v``), per modality with its own scales::

    x0 = cond + (g - 1)(cond - uncond) + stg (cond - perturbed) + (m - 1)(cond - isolated)
    x0 = rescale_noise_cfg(x0, cond, rescale)         (guidance_rescale > 0), then back to a velocity

Here one step is ONE forward of ``LTX2Rows`` over every scheduled request's rows ``[uncond; cond; perturbed;
isolated]`` (``num_outputs`` rows each): STG is per row through the transformer's own ``perturbation_mask`` (a
weight of 1 leaves a row bitwise as it was), the isolation per row by hooks that zero the two cross-modal
attention outputs of the isolated rows (their residual adds then leave the states as diffusers' skipped branch
does). Where no block named in ``spatio_temporal_guidance_blocks`` perturbs its attention (``perturbed_attn``
off, as in the tiny model, or an index past the last block), diffusers' STG pass computes exactly the
conditional pass, so its term is 0 and no perturbed row is run. Request mode runs the same step loop for its wave.

Served as diffusers' defaults: ``guidance_scale`` is the request's (video CFG); the audio CFG scale (7), the STG,
modality and rescale scales are the ``__call__`` defaults, so CFG rows run whenever either CFG scale is above 1
(always, with the audio default). ``fps`` is ``frame_rate``: it conditions the video's rotary positions and fixes
the audio length (``round(frames / fps x 25)`` latent frames here), so it is in both compatibility keys.

Audio: LTX2Pipeline has no switch to skip it, and the video depends on it (every block's audio-to-video
attention reads the audio states), so the audio latents are always denoised with the video, equal to diffusers.
The waveform (audio VAE, then vocoder: ``.audio`` of the bare call, ``(n, 2, samples)`` at
``vocoder.config.output_sampling_rate``) is decoded with the frames when a request finishes (``decode``: an
``Audio`` on its output, float32 on the host, equal to diffusers') and muxed by the server as an AAC track next to
the H.264 one (``videoio.encode_mp4``), or served alone as WAV (``variant=audio``). A preview is frames only.

Image-to-video (``LTX2ImageToVideoPipeline``, the same components): a request with a reference image
(``input_reference``) starts from it, one without is text-to-video, on the same model (``ModelInfo.reference``
"optional"; a folder whose model_index names ``LTX2ImageToVideoPipeline`` serves image-to-video only:
"required"). As diffusers does, the picture is re-compressed by H.264 at the text encoder generation's CRF (33
before LTX-2.5), resized (bilinear), VAE-encoded (its mode) and normalised into the first latent frame, which
stays clean: its tokens get timestep 0 (a timestep per video token) and the scheduler never moves them; the
other frames start from the noise. A request's ``n`` videos all start from the picture, each from its own
generator (diffusers' ``generator`` list takes one image per video). T2V and I2V requests share a forward: where
one row of it has a first frame, every row gets a timestep per video token (a text-to-video row its t on every
token, equal to the per-row timestep within 4e-7) and the audio its per-row timestep, as the image-to-video
pipeline calls the transformer. So neither compatibility key names the reference.

Frames are ``8k + 1`` (the VAE's temporal factor: diffusers decodes ``(F - 1) // 8 x 8 + 1`` frames for any
other count); height and width are multiples of 32 (``ValueError`` in diffusers). CFG parallel splits a forward's
rows like any denoiser's (every input of ``LTX2Rows`` is per row; the STG and isolation masks too); Ulysses and
ring have no installer for its two token streams (video and audio, with cross-modal attention between them).
LoRA adapts the transformer and the text connectors, as ``LTX2LoraLoaderMixin``: every forward runs inside
``lora_rows("transformer")`` with each request's pass rows, the connectors inside ``lora_rows("connectors")`` with
its [negative; prompt] rows.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import LTX2ImageToVideoPipeline
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
from PIL import Image

from stage_runtime.models.adapter import PipelineAdapter
from stage_runtime.models.refusals import LTX2Refusals
from stage_runtime.models.step_contract import StepContract
from stage_runtime.models.step_state import StepRequestState
from stage_runtime.outputs import Audio, Decoded
from stage_runtime.request import DiffusionRequest

DEFAULT_FRAMES = 121        # LTX2Pipeline.__call__'s count when num_frames is None and there is no duration head


@dataclass(frozen=True)
class Scales:
    """One modality's guidance: CFG, STG, modality isolation, rescale (diffusers' names, audio_* for audio)."""

    cfg: float
    stg: float
    modality: float
    rescale: float

    def guided(self, cond: torch.Tensor, others: dict[str, torch.Tensor]) -> torch.Tensor:
        """x0 guided as LTX2Pipeline adds its terms (a pass that did not run adds 0, as there)."""
        cfg = (self.cfg - 1) * (cond - others["uncond"]) if "uncond" in others else 0
        stg = self.stg * (cond - others["perturbed"]) if "perturbed" in others else 0
        modality = (self.modality - 1) * (cond - others["isolated"]) if "isolated" in others else 0
        x0 = cond + cfg + stg + modality
        return rescale_noise_cfg(x0, cond, guidance_rescale=self.rescale) if self.rescale > 0 else x0


@dataclass
class LTX2State(StepRequestState):
    """A request's step state: the video latents (packed tokens) and, denoised with them, the audio latents."""

    audio_latents: torch.Tensor | None = None
    audio_scheduler: Any = None
    passes: tuple[str, ...] = ()             # its row groups, in order, each num_outputs rows
    scales: tuple[Scales, Scales] | None = None   # (video, audio)

    def tensors_nbytes(self) -> int:
        return super().tensors_nbytes() + self.audio_latents.nbytes

    def move_to(self, device: torch.device) -> None:
        super().move_to(device)
        self.audio_latents = self.audio_latents.to(device, copy=True)


class LTX2Rows(torch.nn.Module):
    """The denoiser of one step: the transformer over rows of different guidance passes, each row perturbed
    (STG) or isolated (no cross-modal attention) on its own. One call per step (the step clock's module)."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.keep: torch.Tensor | None = None        # (rows, 1, 1) bool: False where a row is isolated
        for block in transformer.transformer_blocks:
            for attn in (block.audio_to_video_attn, block.video_to_audio_attn):
                attn.register_forward_hook(self._isolate)

    def _isolate(self, _module, _args, output: torch.Tensor) -> torch.Tensor | None:
        return None if self.keep is None else torch.where(self.keep, output, torch.zeros_like(output))

    def perturbs(self, blocks: list[int]) -> bool:
        """Whether STG at ``blocks`` changes anything: a named block with perturbed self-attention."""
        return any(i in blocks and block.perturbed_attn for i, block in enumerate(self.transformer.transformer_blocks))

    def forward(self, isolated: torch.Tensor, perturbed: torch.Tensor, stg_blocks: list[int],
                **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``isolated``, ``perturbed``: a bool per row; the rest are the transformer's inputs for all rows."""
        stg = {"spatio_temporal_guidance_blocks": stg_blocks,
               "perturbation_mask": (~perturbed).to(inputs["hidden_states"].dtype)} if bool(perturbed.any()) else {}
        self.keep = (~isolated)[:, None, None] if bool(isolated.any()) else None
        try:
            return self.transformer(**inputs, **stg, return_dict=False)
        finally:
            self.keep = None


class LTX2Adapter(LTX2Refusals, StepContract, PipelineAdapter):
    pipeline_classes = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    tiny_kinds = ("ltx2",)
    refuses_long_prompts = True          # a prompt the Gemma encoder would cut is a 400 (engine/prompt_length)
    default_steps = 30
    default_guidance = 3.0
    parallel_kinds = frozenset({"cfg"})
    lora_components = ("transformer", "connectors")          # as LTX2LoraLoaderMixin
    request_key_fields = ("height", "width", "num_frames", "fps", "num_inference_steps", "guidance_scale")
    step_key_fields = ("height", "width", "num_frames", "fps")    # timesteps and guidance are per row

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.rows = LTX2Rows(pipeline.transformer)
        self.defaults = {name: p.default for name, p in inspect.signature(type(pipeline).__call__).parameters.items()}
        # image-to-video: diffusers' pipeline over the same modules (its latents, its bilinear image resize)
        self.i2v = pipeline if isinstance(pipeline, LTX2ImageToVideoPipeline) else \
            LTX2ImageToVideoPipeline(**pipeline.components)

    def parallel_refusal(self, kind: str) -> str | None:
        if kind in ("ulysses", "ring"):
            return ("no sequence-parallel installer fits LTX-2's two token streams (video and audio self-attention, "
                    "audio-to-video and video-to-audio attention between them)")
        if kind == "tp":
            return "distributed/tensor_parallel.py shards diffusers' Attention layers, not LTX2Attention"
        return None

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.rows

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_spatial_compression_ratio)

    def size_multiple(self) -> int:
        return self.vae_scale_factor * self.pipe.transformer_spatial_patch_size

    def default_size(self) -> tuple[int, int]:
        return int(self.defaults["height"]), int(self.defaults["width"])

    def max_sequence_length(self) -> int:
        return int(self.defaults["max_sequence_length"])

    def family_facts(self) -> dict:
        return {"frame_rule": (int(self.pipe.vae_temporal_compression_ratio), 1), "default_frames": DEFAULT_FRAMES,
                "default_fps": int(self.defaults["frame_rate"]),
                "reference": "required" if self.i2v is self.pipe else "optional"}

    def scales(self, guidance_scale: float) -> tuple[Scales, Scales]:
        """(video, audio) guidance of a request: its guidance_scale, the rest as __call__'s defaults (an audio
        scale of None or 0 falls back to the video one, as there)."""
        d = self.defaults
        video = Scales(guidance_scale, d["stg_scale"], d["modality_scale"], d["guidance_rescale"])
        return video, Scales(d["audio_guidance_scale"] or video.cfg, d["audio_stg_scale"] or video.stg,
                             d["audio_modality_scale"] or video.modality, d["audio_guidance_rescale"] or video.rescale)

    # -- request mode: the step loop, to the end, for the whole wave --------------------------------------
    def run_batch(self, requests: list[DiffusionRequest]) -> dict[str, np.ndarray]:
        return self.run_step_loop(requests)

    # -- step contract: LTX2Pipeline.__call__, one step at a time -----------------------------------------
    def prepare_encode(self, request: DiffusionRequest) -> LTX2State:
        s, pipe, n = request.sampling, self.pipe, request.sampling.num_outputs
        video, audio = self.scales(s.guidance_scale)
        do_cfg = video.cfg > 1 or audio.cfg > 1
        passes = (("uncond",) if do_cfg else ()) + ("cond",)
        if (video.stg > 0 or audio.stg > 0) and self.rows.perturbs(self.defaults["spatio_temporal_guidance_blocks"]):
            passes += ("perturbed",)
        if video.modality > 1 or audio.modality > 1:
            passes += ("isolated",)
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            prompt=[request.prompt] * n, negative_prompt=[s.negative_prompt or ""] * n, do_classifier_free_guidance=do_cfg,
            num_videos_per_prompt=1, max_sequence_length=self.max_sequence_length(), device=self.device)
        if do_cfg:
            embeds, mask = torch.cat([negative, embeds]), torch.cat([negative_mask, mask])
        with self.lora_rows("connectors", [(request, len(embeds))]):       # [negative; prompt] rows of one request
            video_embeds, audio_embeds, mask = pipe.connectors(embeds, mask, padding_side=getattr(
                pipe.tokenizer, "padding_side", "left"))
        generators = self.generators([request])
        noisy = None
        if request.reference is None:
            latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels, s.height, s.width, s.num_frames,
                                           0.0, torch.float32, self.device, generators)
        else:
            latents, noisy = self.image_latents(request, embeds.dtype, generators)
        audio_frames = self.audio_frames(s.num_frames, s.fps)
        audio_vae = pipe.audio_vae
        audio_latents = pipe.prepare_audio_latents(n, audio_vae.config.latent_channels, audio_frames,
                                                   audio_vae.config.mel_bins, 0.0, torch.float32, self.device, generators)
        scheduler = self.flow_scheduler(s.num_inference_steps, latents.shape[1])
        frames, height, width = self.latent_grid(s.num_frames, s.height, s.width)
        rope, audio_rope = pipe.transformer.rope, pipe.transformer.audio_rope
        cond = {"video_embeds": video_embeds, "audio_embeds": audio_embeds, "mask": mask,
                "video_coords": rope.prepare_video_coords(1, frames, height, width, self.device, fps=float(s.fps)),
                "audio_coords": audio_rope.prepare_audio_coords(1, audio_frames, self.device)}
        if noisy is not None:
            cond["noisy"] = noisy
        return LTX2State(request, scheduler, latents, do_cfg, cond=cond, audio_latents=audio_latents,
                         audio_scheduler=copy.deepcopy(scheduler), passes=passes, scales=(video, audio))

    def image_latents(self, request: DiffusionRequest, dtype: torch.dtype,
                      generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Image-to-video: the packed latents (the picture's in the first frame, noise elsewhere) and, per video
        token, 1 where it is denoised (0: the first frame's), as LTX2ImageToVideoPipeline prepares them."""
        s, i2v, n = request.sampling, self.i2v, request.sampling.num_outputs
        image = Image.fromarray(request.reference, mode="RGB")
        crf = resolve_default_image_crf(i2v.text_encoder)           # the call's default (image_crf=None)
        if crf != 0:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
        pixels = i2v.video_processor.preprocess(image, height=s.height, width=s.width).to(self.device, dtype)
        latents, first_frame = i2v.prepare_latents(
            pixels.expand(n, -1, -1, -1), n, i2v.transformer.config.in_channels, s.height, s.width, s.num_frames,
            0.0, torch.float32, self.device, generators)
        return latents, 1 - first_frame

    def latent_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        pipe = self.pipe
        return ((frames - 1) // pipe.vae_temporal_compression_ratio + 1, height // pipe.vae_spatial_compression_ratio,
                width // pipe.vae_spatial_compression_ratio)

    def audio_frames(self, frames: int, fps: int) -> int:
        """Audio latent frames of a clip: its duration at the audio VAE's latent rate, rounded (as diffusers)."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(frames / float(fps) * per_second)

    def flow_scheduler(self, steps: int, video_tokens: int):
        """A private scheduler: sigmas 1 → 1/steps, shifted by ``mu`` of the video token count (LTX's defaults)."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        config = scheduler.config
        mu = calculate_shift(video_tokens, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=self.device, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def pass_rows(self, st: LTX2State, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s rows for one pass: the CFG pair has its own rows; the other passes take the prompt's."""
        n = st.request.sampling.num_outputs
        if len(tensor) == 1:
            return tensor.expand(n, *tensor.shape[1:])
        if not st.do_cfg or name == "uncond":
            return tensor[:n]
        return tensor[n:]

    @staticmethod
    def video_timestep(st: LTX2State, n: int, per_token: bool) -> torch.Tensor:
        """The video's timestep input for n rows: t per row, or (a forward with an image-to-video row) t per video
        token, 0 on a first frame given by the request's picture (diffusers' ``t x (1 - conditioning_mask)``)."""
        t = st.timestep.expand(n)
        if not per_token:
            return t
        noisy = st.cond.get("noisy")
        return t.unsqueeze(-1) * noisy if noisy is not None else t.unsqueeze(-1).expand(n, st.latents.shape[1])

    def denoise_step(self, states: list[LTX2State]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dtype = states[0].cond["video_embeds"].dtype
        per_token = any("noisy" in st.cond for st in states)
        inputs: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
            "timestep", "sigma", "encoder_attention_mask", "video_coords", "audio_coords", "isolated", "perturbed")}
        for st in states:
            n = st.request.sampling.num_outputs
            for name in st.passes:
                row = {"hidden_states": st.latents.to(dtype), "audio_hidden_states": st.audio_latents.to(dtype),
                       "timestep": self.video_timestep(st, n, per_token), "sigma": st.timestep.expand(n),
                       "isolated": torch.full((n,), name == "isolated", device=self.device),
                       "perturbed": torch.full((n,), name == "perturbed", device=self.device),
                       **{key: self.pass_rows(st, name, st.cond[cond_key]) for key, cond_key in (
                           ("encoder_hidden_states", "video_embeds"), ("audio_encoder_hidden_states", "audio_embeds"),
                           ("encoder_attention_mask", "mask"), ("video_coords", "video_coords"),
                           ("audio_coords", "audio_coords"))}}
                for key, value in row.items():
                    inputs[key].append(value)
        fused = {key: torch.cat(values) for key, values in inputs.items()}
        fused["audio_encoder_attention_mask"] = fused["encoder_attention_mask"]
        if per_token:                               # the audio's timestep stays per row (else: the video's)
            fused["audio_timestep"] = fused["sigma"]
        s0 = states[0].request.sampling
        frames, height, width = self.latent_grid(s0.num_frames, s0.height, s0.width)
        sizes = [len(st.passes) * st.request.sampling.num_outputs for st in states]
        with self.lora_rows("transformer", [(st.request, size) for st, size in zip(states, sizes, strict=True)]):
            video_out, audio_out = self.rows(
                stg_blocks=self.defaults["spatio_temporal_guidance_blocks"], num_frames=frames, height=height,
                width=width, fps=float(s0.fps), audio_num_frames=states[0].audio_latents.shape[1],
                use_cross_timestep=self.defaults["use_cross_timestep"], **fused)
        return [self.guide(st, v, a) for st, v, a in zip(states, video_out.float().split(sizes),
                                                          audio_out.float().split(sizes), strict=True)]

    def guide(self, st: LTX2State, video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's guided (video, audio) velocities from its rows, as LTX2Pipeline forms them on x0."""
        i, n = st.step_index, st.request.sampling.num_outputs
        out = []
        for pred, latents, scheduler, scales in ((video, st.latents, st.noise_scheduler, st.scales[0]),
                                                 (audio, st.audio_latents, st.audio_scheduler, st.scales[1])):
            sigma = scheduler.sigmas[i]
            x0 = {name: latents - rows * sigma for name, rows in zip(st.passes, pred.split(n), strict=True)}
            guided = scales.guided(x0.pop("cond"), x0)
            out.append((latents - guided) / sigma)
        return out[0], out[1]

    def noise_step(self, state: LTX2State, pred: tuple[torch.Tensor, torch.Tensor]) -> None:
        video, audio = pred
        t = state.timestep
        latents = state.noise_scheduler.step(video, t, state.latents, return_dict=False)[0]
        noisy = state.cond.get("noisy")                 # image-to-video: the first frame's tokens stay as given
        state.latents = latents if noisy is None else torch.where(noisy[..., None] > 0, latents, state.latents)
        state.audio_latents = state.audio_scheduler.step(audio, t, state.audio_latents, return_dict=False)[0]
        state.step_index += 1

    def post_decode(self, state: LTX2State) -> np.ndarray:
        """uint8 (num_outputs, F, H, W, 3): unpacked, un-normalised by the VAE's latent mean and std, decoded (at
        decode timestep 0, diffusers' default: no decode noise), as the pipeline's video processor gives them."""
        pipe, vae, s = self.pipe, self.pipe.vae, state.request.sampling
        latents = pipe._unpack_latents(state.latents, *self.latent_grid(s.num_frames, s.height, s.width),
                                       pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        latents = latents.to(state.cond["video_embeds"].dtype)
        timestep = torch.zeros(len(latents), device=latents.device, dtype=latents.dtype) \
            if vae.config.timestep_conditioning else None
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
        return self.to_uint8(pipe.video_processor.postprocess_video(video, output_type="np"))

    def decode(self, state: LTX2State) -> Decoded:
        """A finished request's frames and, decoded beside them, its sound (float32 on the host)."""
        waveform = self.decode_audio(state)
        return Decoded(self.post_decode(state), Audio(waveform.float().cpu().numpy(), self.sample_rate))

    @property
    def sample_rate(self) -> int:
        return int(self.pipe.vocoder.config.output_sampling_rate)

    def decode_audio(self, state: LTX2State) -> torch.Tensor:
        """The waveform of the state's audio latents: ``(num_outputs, channels, samples)`` at
        ``vocoder.config.output_sampling_rate``, as the bare call's ``.audio``."""
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        latents = pipe._denormalize_audio_latents(state.audio_latents, audio_vae.latents_mean, audio_vae.latents_std)
        latents = pipe._unpack_audio_latents(latents, state.audio_latents.shape[1],
                                             num_mel_bins=audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio)
        return pipe.vocoder(audio_vae.decode(latents.to(audio_vae.dtype), return_dict=False)[0])
