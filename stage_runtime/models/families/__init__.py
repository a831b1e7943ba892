"""The model families: one module per family, its adapter class(es) and everything only that family needs.

    sd               Stable Diffusion 1.x/2.x (generation, img2img, inpainting)
    sdxl             Stable Diffusion XL (its edits in sdxl_edits)
    sd3              Stable Diffusion 3 / 3.5 (MMDiT)
    dit              DiT, class-conditional (and the trained tiny digits)
    flux             FLUX.1 (its edits in flux_edits)
    flux_kontext     FLUX.1 Kontext instruction edits
    flux2            FLUX.2 [dev]
    flux2_klein      FLUX.2 [klein]
    qwen_image       Qwen-Image
    qwen_image_edit  Qwen-Image-Edit and -Edit-Plus (the Qwen2.5-VL processor in qwen_vl_processor)
    zimage           Z-Image
    wan              Wan 2.1 / 2.2 text- and image-to-video (its Ulysses installer in wan_ulysses)
    wan_vace         Wan VACE video-to-video
    ltx2             LTX-2 text/image-to-video with sound
    hunyuan_video15  HunyuanVideo-1.5 text-to-video (image-to-video in hunyuan_video15_i2v)
    generic          any other diffusers pipeline, request mode only (the registry's fallback)

A family module declares its facts in its adapter class body (``pipeline_classes``, ``tiny_kinds``: read without
importing it by ``stage_runtime.model_catalog``; ``guidance``, ``parallel_kinds``, ...) and its sequence-parallel
hook beside them: ``sequence_parallel``, the installer Ulysses and ring go through (default: the self-attention
skeleton ``distributed.ulysses``; MMDiTs point at ``distributed.ulysses_joint``'s; a family with an attention of
its own defines its installer in its own module). A helper module private to one family sits beside it, named
after it (``sdxl_edits``, ``flux_edits``, ``qwen_vl_processor``, ``wan_ulysses``: Wan's installer, apart only
because ``wan.py`` with it would pass the 400-line limit), so one family is its module (+ its ``*_ulysses``
sibling where it has one). What every family shares stays in ``stage_runtime.models`` (adapter, registry, step
state/contract/checkpoint, block and prompt caches, refusals, flow matching, edit images, routed denoisers, LoRA,
tiny builders); the sequence-parallel skeleton stays in ``stage_runtime.distributed``.
"""
