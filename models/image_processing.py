"""Images (PIL, uint8 arrays) to the pixel values a vision tower takes, as ``preprocessor_config.json`` says.

With ``transformers`` installed, the checkpoint's own image processor (``AutoImageProcessor``: for Llava
1.5, ``CLIPImageProcessor``). Without it, :class:`ClipPreprocessor` does CLIP's steps from the same
fields, with PIL: RGB, resize the shortest edge to ``size["shortest_edge"]`` (``resample``, bicubic by
default), center crop to ``crop_size``, ``* rescale_factor``, ``(x - image_mean) / image_std``, ``[C, H, W]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .loader import CheckpointError

__all__ = ["ClipPreprocessor", "is_raw_image", "load_image_processor", "process_images"]

PREPROCESSOR_CONFIG = "preprocessor_config.json"

ImageProcessor = Callable[[list[Any]], torch.Tensor]
"""``process(images)``: raw images to pixel values ``[N, C, H, W]`` (fp32)."""


def is_raw_image(image: Any) -> bool:
    """A PIL image or a uint8 array ``[H, W]`` / ``[H, W, C]`` (to process); a tensor is pixel values already
    (the model checks them)."""
    return isinstance(image, np.ndarray) or type(image).__module__.startswith("PIL.")


def _to_pil(image: Any) -> Any:
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(f"image arrays must be uint8 [H, W] or [H, W, C]; got {image.dtype} {list(image.shape)}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    return image


class ClipPreprocessor:
    """CLIP's preprocessing from the fields of a ``preprocessor_config.json`` (dict ``config``)."""

    def __init__(self, config: dict[str, Any], where: str = PREPROCESSOR_CONFIG) -> None:
        size = config.get("size", {"shortest_edge": 224})
        crop = config.get("crop_size", {"height": 224, "width": 224})
        self.shortest_edge = size["shortest_edge"] if isinstance(size, dict) and "shortest_edge" in size else None
        if config.get("do_resize", True) and self.shortest_edge is None:
            raise CheckpointError(f"{where}: size must be {{'shortest_edge': N}} (CLIP's resize); got {size!r}")
        self.do_resize = config.get("do_resize", True)
        self.resample = int(config.get("resample", 3))  # PIL.Image.BICUBIC
        self.crop = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
        self.do_center_crop = config.get("do_center_crop", True)
        self.do_rescale, self.rescale_factor = config.get("do_rescale", True), config.get("rescale_factor", 1 / 255)
        self.do_normalize = config.get("do_normalize", True)
        self.mean = np.array(config.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), dtype=np.float32)
        self.std = np.array(config.get("image_std", [0.26862954, 0.26130258, 0.27577711]), dtype=np.float32)
        self.do_convert_rgb = config.get("do_convert_rgb", True)

    def __call__(self, images: list[Any]) -> torch.Tensor:
        return torch.stack([self._one(_to_pil(im)) for im in images])

    def _one(self, image: Any) -> torch.Tensor:
        if self.do_convert_rgb:
            image = image.convert("RGB")
        if self.do_resize:
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            image = image.resize((new_short, new_long) if w <= h else (new_long, new_short), resample=self.resample)
        x = np.asarray(image)
        if self.do_center_crop:
            ch, cw = self.crop
            top, left = (x.shape[0] - ch) // 2, (x.shape[1] - cw) // 2
            x = x[top:top + ch, left:left + cw]
        x = x.astype(np.float32)
        if self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        if self.do_normalize:
            x = (x - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))  # [C, H, W]


def load_image_processor(path: str, use_transformers: bool = True) -> ImageProcessor | None:
    """The image processor of checkpoint directory ``path``; None without a ``preprocessor_config.json``.

    ``use_transformers``: the checkpoint's ``AutoImageProcessor`` when ``transformers`` imports, else (or
    if False) :class:`ClipPreprocessor`.
    """
    file = os.path.join(path, PREPROCESSOR_CONFIG)
    if not os.path.isfile(file):
        return None
    if use_transformers:
        try:
            from transformers import AutoImageProcessor
        except ImportError:
            pass
        else:
            processor = AutoImageProcessor.from_pretrained(path)
            return lambda images: processor(images=[_to_pil(im) for im in images], return_tensors="pt")["pixel_values"]
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable: {e}") from None
    return ClipPreprocessor(config, file)


def process_images(images: Any, processor: ImageProcessor | None, where: str) -> Any:
    """One prompt's images with every raw one (:func:`is_raw_image`) made pixel values by ``processor``;
    float tensors (pixel values already) pass as they are."""
    listed = list(images) if isinstance(images, Sequence) and not isinstance(images, np.ndarray) else [images]
    if not any(is_raw_image(im) for im in listed):
        return images
    if processor is None:
        raise ValueError(f"{where}: raw images (PIL, uint8) need the checkpoint's {PREPROCESSOR_CONFIG}; this "
                         "model has none: pass pixel values ([C, H, W] float tensors, normalized as CLIP's)")
    raw = [i for i, im in enumerate(listed) if is_raw_image(im)]
    pixels = processor([listed[i] for i in raw])
    for i, px in zip(raw, pixels):
        listed[i] = px
    return listed
