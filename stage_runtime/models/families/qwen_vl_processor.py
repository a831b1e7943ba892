"""The Qwen2.5-VL processor of a Qwen-Image-Edit folder, for images and text only.

The Edit pipelines encode the instruction together with the input image(s) through their ``processor``
component (``Qwen2VLProcessor``: the tokenizer, and the image processor that cuts a picture into 14x14
patches and puts one ``<|image_pad|>`` token per 2x2 of them into the text). transformers 5 builds a
``Qwen2VLProcessor`` only with its video processor, which needs torchvision; the pipelines never pass a video.
So the stage builds the folder's processor without it: :class:`ImageTextProcessor` is ``Qwen2VLProcessor``
less the video part, loaded from the folder's ``processor/`` files (the tokenizer and the image processor's
config, on transformers' PIL backend), and handed to ``from_pretrained`` in place of the folder's own. The
tiny builders make theirs with it too (``model_index.json`` still names ``Qwen2VLProcessor``, as a real
folder does).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2VLProcessor

PROCESSOR_DIR = "processor"


class ImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` for text and images (its modalities are the parameters of ``__init__``: no video)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: str | Path) -> ImageTextProcessor:
    """The processor of a Qwen-Image-Edit pipeline folder (its ``processor/`` subfolder)."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(folder) / PROCESSOR_DIR
    tokenizer = Qwen2Tokenizer.from_pretrained(path, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    return ImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                              chat_template=tokenizer.chat_template)
