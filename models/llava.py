"""Llava 1.5: a CLIP vision tower, a two-layer GELU projector, and the Llama language model.

An image becomes ``P`` embeddings (``(image_size / patch_size) ** 2``, 576
for Llava 1.5's 336-pixel ViT-L/14): the vision tower's hidden state
``vision_feature_layer`` (-2: the input of its last layer), without the CLS
token (``vision_feature_select_strategy="default"``), through ``linear_1`` ->
GELU -> ``linear_2``. A prompt holds ``P`` image tokens (``image_token_index``)
per image, as HF's processor expands ``<image>``; their embeddings are replaced
by the image's, in order.

Tokens are flattened as in :mod:`models.llama`: ``forward(input_ids [T],
positions [T], inputs_embeds=None)``. The compiled decoder is
:class:`models.llama.LlamaModel` and is always called with ``inputs_embeds``
(text embeddings with image features scattered in at prefill, plain text
embeddings otherwise): the dispatcher checks each call against the traced one,
and a decoder traced with ``inputs_embeds=None`` refuses a tensor there. The
vision tower runs eagerly (see :mod:`models.clip`).

With :class:`models.LLM`, pass one image (``[C, H, W]``), a stack
(``[N, C, H, W]``) or None per prompt: ``llm.generate(prompts, images=[...])``.
Tensors are pixel values already resized and normalized as CLIP's processor does;
PIL images and uint8 arrays are processed as the checkpoint's
``preprocessor_config.json`` says (:mod:`models.image_processing`). Text prompts
(``"USER: <image>\n..."``) have each lone image token expanded to ``P`` by ``LLM``.

Checkpoints: the hub's Llava 1.5 (transformers 4 names: ``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.vision_model.*``,
``multi_modal_projector.*``) and transformers 5's (``model.language_model.*``,
``lm_head.*``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``) both load.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .clip import CLIPVisionConfig, CLIPVisionModel, activation
from .layers import ConfigError
from .llama import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["LlavaConfig", "LlavaForConditionalGeneration", "LlavaImageInput", "expand_image_tokens"]

# transformers' LlamaConfig defaults: HF writes only the fields that differ from them, and the hub's
# Llava 1.5 text_config gives little more than vocab_size and max_position_embeddings.
_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6)
# LlavaConfig's vision tower when vision_config is absent: CLIP ViT-L/14 at 336 pixels.
_LLAVA_VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14)


@dataclasses.dataclass
class LlavaConfig:
    """The fields of an HF Llava ``config.json`` that the model uses."""

    text_config: LlamaConfig
    vision_config: CLIPVisionConfig
    image_token_index: int = 32000
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int | list[int] = -2
    vision_feature_select_strategy: str = "default"
    multimodal_projector_bias: bool = True
    torch_dtype: str | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlavaConfig:
        text = dict(hf.get("text_config") or {})
        if text.get("model_type", "llama") != "llama":
            raise ConfigError(f"text_config.model_type: expected 'llama' (Llava 1.5's language model); "
                             f"got {text['model_type']!r}")
        vision = hf.get("vision_config")
        if vision is not None and vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ConfigError(f"vision_config.model_type: expected 'clip_vision_model'; got {vision['model_type']!r}")
        text = {**_LLAMA_DEFAULTS, **text}
        if hf.get("tie_word_embeddings"):  # transformers 5 keeps the flag at the top level
            text["tie_word_embeddings"] = True
        strategy = hf.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ConfigError(f"vision_feature_select_strategy: expected 'default' (drop CLS) or 'full'; "
                             f"got {strategy!r}")
        layer = hf.get("vision_feature_layer", -2)
        if not (isinstance(layer, int) or (isinstance(layer, list) and layer and all(isinstance(i, int) for i in layer))):
            raise ConfigError(f"vision_feature_layer: expected an int or a non-empty list of ints; got {layer!r}")
        act = hf.get("projector_hidden_act", "gelu")
        activation(act, "projector_hidden_act")
        try:
            text_config = LlamaConfig.from_hf(text)
        except ConfigError as e:
            raise ConfigError(f"text_config.{e}") from None
        config = cls(
            text_config=text_config,
            vision_config=CLIPVisionConfig.from_hf(_LLAVA_VISION_DEFAULTS if vision is None else vision),
            image_token_index=hf.get("image_token_index", hf.get("image_token_id", 32000)),
            projector_hidden_act=act,
            vision_feature_layer=layer,
            vision_feature_select_strategy=strategy,
            multimodal_projector_bias=hf.get("multimodal_projector_bias", True),
            torch_dtype=hf.get("torch_dtype", hf.get("dtype")) or text.get("torch_dtype", text.get("dtype")),
        )
        if not 0 <= config.image_token_index < config.vocab_size:
            raise ConfigError(f"image_token_index: expected a token id in [0, vocab_size={config.vocab_size}); "
                             f"got {config.image_token_index}")
        return config

    # What the runner reads of a model's config.
    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text_config.max_position_embeddings

    @property
    def feature_layers(self) -> list[int]:
        layer = self.vision_feature_layer
        return [layer] if isinstance(layer, int) else list(layer)

    @property
    def num_image_tokens(self) -> int:
        """Image tokens (and embeddings) per image: one per patch, plus CLS with the "full" strategy."""
        return self.vision_config.num_patches + (self.vision_feature_select_strategy == "full")


def expand_image_tokens(tokens: Sequence[int], image_token_index: int, num_image_tokens: int) -> list[int]:
    """Replace each lone image token (an unexpanded ``<image>``) by ``num_image_tokens`` of them, as HF's
    processor does; runs already ``num_image_tokens`` long are kept."""
    out: list[int] = []
    i = 0
    while i < len(tokens):
        if tokens[i] != image_token_index:
            out.append(tokens[i])
            i += 1
            continue
        j = i
        while j < len(tokens) and tokens[j] == image_token_index:
            j += 1
        out += [image_token_index] * (num_image_tokens if j - i == 1 else j - i)
        i = j
    return out


@dataclasses.dataclass
class LlavaImageInput:
    """One prompt's images, checked against its tokens (:meth:`LlavaForConditionalGeneration.prepare_images`).

    Args:
        pixel_values: ``[N, C, H, W]`` on the model's device and dtype.
        token_offsets: ``[N * P]`` int64 on the model's device, where in the prompt the image tokens are.
    """

    pixel_values: torch.Tensor
    token_offsets: torch.Tensor


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        d_in = config.vision_config.hidden_size * len(config.feature_layers)
        d = config.text_config.hidden_size
        self.linear_1 = nn.Linear(d_in, d, bias=config.multimodal_projector_bias)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(d, d, bias=config.multimodal_projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))  # [N, P, D_vision] -> [N, P, D_text]


class LlavaForConditionalGeneration(nn.Module):
    """Vision tower + projector + :class:`LlamaForCausalLM`; same ``forward`` / ``compute_logits`` as it.

    ``embed_multimodal`` builds a step's ``inputs_embeds`` with the images of
    the sequences it prefills; ``prepare_images`` checks a prompt's images
    against its image tokens once, when the runner admits the prompt.
    """

    config_class = LlavaConfig

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = CLIPVisionModel(config.vision_config, config.feature_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = LlamaForCausalLM(config.text_config)
        #: checkpoint tensors with no parameter here (names after :meth:`canonical_checkpoint_name`), skipped
        self.ignored_checkpoint_names = (
            r"\.rotary_emb\.inv_freq$",
            r"^vision_tower\.embeddings\.position_ids$",  # a buffer some transformers 4 checkpoints stored
            *self.vision_tower.unused_checkpoint_names("vision_tower."),
            *((r"^language_model\.lm_head\.weight$",) if config.text_config.tie_word_embeddings else ()),
        )

    # ------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]``; without ``inputs_embeds``, the text embeddings of ``input_ids``."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)  # [T, hidden]
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)  # [B, vocab]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, P, hidden]``: the embeddings that replace each image's P image tokens."""
        states = self.vision_tower(pixel_values)  # per feature layer: [N, P + 1, D_vision]
        if self.config.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop CLS
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def embed_multimodal(self, input_ids: torch.Tensor,
                         images: Sequence[tuple[int, LlavaImageInput]]) -> torch.Tensor:
        """A step's ``inputs_embeds`` ``[T, hidden]``: text embeddings, with image features in place of image tokens.

        Args:
            input_ids: ``[T]``, the step's tokens.
            images: ``(start, image_input)`` per sequence whose prompt (with images) is in this step,
                ``start`` being the index in ``input_ids`` of the prompt's first token.
        """
        embeds = self.embed_input_ids(input_ids)
        if not images:
            return embeds
        pixels = torch.cat([im.pixel_values for _, im in images])  # one vision-tower call for the step
        rows = torch.cat([start + im.token_offsets for start, im in images])
        features = self.get_image_features(pixels)  # [N, P, hidden]
        return embeds.index_copy(0, rows, features.reshape(-1, embeds.shape[-1]).to(embeds.dtype))

    def prepare_images(self, tokens: Sequence[int], images: torch.Tensor | Sequence[torch.Tensor],
                       where: str = "images") -> LlavaImageInput:
        """Check a prompt's images against its image tokens; put them on the model's device and dtype.

        Args:
            tokens: the prompt, with ``P`` consecutive ``image_token_index`` per image (see :func:`expand_image_tokens`).
            images: ``[C, H, W]``, ``[N, C, H, W]``, or a list of ``[C, H, W]``; CLIP-normalized pixel values.
            where: names the prompt in errors.

        Raises:
            ValueError: image shape or size other than the config's; image-token count or runs that
                do not match the number of images.
        """
        pixels = self._pixel_batch(images, where)
        n, p, image_token = pixels.shape[0], self.config.num_image_tokens, self.config.image_token_index
        offsets = [i for i, t in enumerate(tokens) if t == image_token]
        runs: list[tuple[int, int]] = []  # (start, length)
        for i in offsets:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        if len(offsets) != n * p:
            raise ValueError(f"{where}: {n} image(s) need {n * p} image tokens (id {image_token}, {p} per image); "
                             f"the prompt has {len(offsets)} in {len(runs)} run(s)")
        bad = [(s, k) for s, k in runs if k % p]
        if bad:
            raise ValueError(f"{where}: image-token run of {bad[0][1]} token(s) at position {bad[0][0]}; each image "
                             f"takes {p} consecutive image tokens (expand each <image> with expand_image_tokens)")
        param = self.multi_modal_projector.linear_1.weight
        return LlavaImageInput(pixels.to(param.device, param.dtype),
                               torch.tensor(offsets, dtype=torch.int64, device=param.device))

    def _pixel_batch(self, images: torch.Tensor | Sequence[torch.Tensor], where: str) -> torch.Tensor:
        """``images`` as one ``[N, C, H, W]`` tensor, each image checked against the vision config."""
        if isinstance(images, torch.Tensor) and images.dim() in (3, 4):
            listed = list(images.unsqueeze(0) if images.dim() == 3 else images)
        elif isinstance(images, Sequence) and all(isinstance(im, torch.Tensor) for im in images):
            listed = list(images)
        else:
            what = f"shape {list(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise TypeError(f"{where}: expected a [C, H, W] or [N, C, H, W] tensor or a list of [C, H, W] "
                            f"tensors; got {what}")
        if not listed:
            raise ValueError(f"{where}: no image given (pass None for a prompt without images)")
        vc = self.config.vision_config
        expected = [vc.num_channels, vc.image_size, vc.image_size]
        for i, im in enumerate(listed):
            if list(im.shape) != expected:
                raise ValueError(f"{where}: image {i} has shape {list(im.shape)}; the vision tower takes "
                                 f"{expected} (num_channels, image_size, image_size), resized and normalized "
                                 "as CLIP's processor does")
            if not im.is_floating_point():
                raise ValueError(f"{where}: image {i} has dtype {im.dtype}; expected floating-point pixel values")
        return torch.stack(listed)

    # ------------------------------------------------------------ loading
    def canonical_checkpoint_name(self, name: str) -> str:
        """Our name for checkpoint tensor ``name``, from either the transformers 4 or the 5 layout."""
        for old, new in _V5_PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name.startswith("vision_tower.vision_model."):  # the hub's CLIPVisionModel nests one more level
            name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
        return name


# transformers 5 checkpoint prefixes -> ours (transformers 4's, minus CLIPVisionModel's ``vision_model.``)
_V5_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
