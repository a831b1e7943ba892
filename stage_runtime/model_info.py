"""What the engine needs to know about a loaded model, as plain data (crosses processes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    pipeline_class: str              # diffusers class name from model_index.json, e.g. "StableDiffusionPipeline"
    adapter: str                     # "module:Class" of the adapter serving it
    default_height: int
    default_width: int
    default_steps: int
    default_guidance: float
    size_multiple: int               # height and width must be multiples of this
    fixed_size: bool                 # True when the model only serves (default_height, default_width), e.g. DiT
    supports_request_batch: bool     # several requests fused into one pipeline call
    supports_step_execution: bool    # the four-method step contract (step mode)
    num_attention_heads: int         # of the denoiser; topology checks (Ulysses degree must divide it)
    max_steps: int | None = None     # the noise scheduler's limit on num_inference_steps (None: unknown)
    parallel_kinds: tuple[str, ...] = ()   # in-model parallelism the family runs: "cfg", "ulysses", "ring", "tp" (DP: always)
    guidance: str = "cfg"            # "cfg" (uncond+cond rows), "true_cfg" (a negative pass), "distilled"
                                     # (a guidance embedding, no negative pass) or "none"
    # diffusers' true CFG (FLUX.1, Kontext): a negative pass per step from true_cfg_scale > 1 and a negative prompt
    # (stage_runtime.true_cfg); False: true_cfg_scale over 1 is a 400.
    true_cfg: bool = False
    max_sequence_length: int | None = None   # text tokens the prompt encoder keeps (None: not text-conditioned)
    # The tokenizer.json (absolute path) the engine counts a prompt's tokens with, for a family that refuses a
    # prompt longer than max_sequence_length at admission (None: the family cuts it, as diffusers does).
    prompt_tokenizer: str | None = None
    # What must be equal for requests to share one pipeline call (request mode) / one denoiser forward (step
    # mode): names of SamplingParams fields (and "task", the edit task, where it changes the sequence, and
    # "edit_shapes", the uploaded images' sizes, where they give the sequence: DiffusionRequest.key_value).
    # Defaults = RequestBatchKey / StepBatchKey (stage_runtime.request).
    request_key: tuple[str, ...] = ("height", "width", "num_inference_steps", "guidance_scale")
    step_key: tuple[str, ...] = ("height", "width", "guidance_scale")
    edit_tasks: tuple[str, ...] = ()         # what POST /v1/images/edits can run: "img2img", "inpaint", "instruct"
    edit_step_rule: str = "int"              # an edit's step count from strength (EditInput.denoise_steps)
    max_edit_images: int = 1                 # uploaded images an edit may give (Qwen-Image-Edit-Plus: several)
    edits_only: bool = False                 # the family edits and makes no image from text alone (Qwen-Image-Edit)
    # Why this stage cannot run the block cache (a UNet family, the generic adapter, a parallel topology),
    # or None when it can (stage_runtime.models.block_cache).
    block_cache_refusal: str | None = "this model family has no block cache"
    lora_components: tuple[str, ...] = ()    # pipeline components LoRA files may target ("unet", "text_encoder")
    # "module:Class" defining the adapter's check_request, the family's refusals the engine runs at admission
    # (stage_runtime.models.refusals: torch-free, so the engine process imports it alone).
    refusals: str = "stage_runtime.models.refusals:Refusals"
    # Class-conditional families (DiT): the class count and the pipeline's label → class id table (its id2label,
    # one entry per comma-separated name), which the family's admission check maps a prompt with.
    num_classes: int | None = None
    class_labels: tuple[tuple[str, int], ...] = ()
    # The generic adapter: the request-facing parameters its pipeline's __call__ takes (None: a dedicated
    # adapter, which uses every request field); what the call lacks is refused at admission, never dropped.
    call_params: tuple[str, ...] | None = None
    # Video families: frames must be multiple·k + remainder (Wan (4, 1): 4k+1; None: an image family), the
    # defaults, a bound, and whether the family takes guidance_scale_2 (Wan 2.2's second expert).
    frame_rule: tuple[int, int] | None = None
    default_frames: int | None = None
    default_fps: int | None = None
    max_frames: int | None = None
    takes_guidance_2: bool = False
    # An image-to-video family's reference image (``input_reference``): "required", "optional" (with one the
    # video starts from it, without one it is text-to-video: LTX-2), or None (a reference is a 400).
    reference: str | None = None
    # A video-to-video family (Wan VACE): takes a source video, a mask video and reference images
    # (``input_video``, ``mask_video``, ``reference_image[k]``; stage_runtime.video_request.VideoInput), at most
    # this many reference images; 0: none of them (a source video is a 400).
    max_reference_images: int = 0
    video_input: bool = False
    # A family whose pipeline sizes the video from its picture (HunyuanVideo-1.5 I2V): the (height, width) buckets
    # it picks the nearest aspect ratio from, which a request without a size gets (video_request.reference_size).
    reference_buckets: tuple[tuple[int, int], ...] = ()
    # The loaded model's identity (classes, configs, a sample of the denoiser's weights; set by the model runner):
    # a step checkpoint resumes only on a model of the same fingerprint (stage_runtime.checkpoint).
    fingerprint: str | None = None

    @property
    def video(self) -> bool:
        return self.frame_rule is not None

    @property
    def supports_edits(self) -> bool:
        return bool(self.edit_tasks)
