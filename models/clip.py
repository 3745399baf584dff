"""CLIP's vision encoder (ViT), as Llava uses it: the hidden states of chosen layers, no pooling head.

Patch embedding (a stride-``patch`` convolution) + class embedding + learned
position embedding, ``pre_layrnorm``, then pre-LayerNorm encoder layers
(bidirectional attention, ``fc1`` -> quick_gelu -> ``fc2``). Images are
``[N, C, H, W]``, already resized and normalized as CLIP's processor does, of
exactly ``image_size`` pixels a side (no position interpolation).

It runs eagerly, outside the compiled decoder: it sees each image once, at
prefill, so its per-call overhead is not on the decode path, and an image
batch of 1 (Dynamo specializes sizes 0 and 1) needs no special first call.
Only the layers up to the deepest feature layer are built: Llava 1.5 reads
layer -2 of 24, so the last layer and ``post_layernorm`` are never loaded.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers import MergedLinear

__all__ = ["CLIPVisionConfig", "CLIPVisionModel", "ACTIVATIONS"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation, ``x * sigmoid(1.702 x)`` (OpenAI's sigmoid fit of GELU)."""
    return x * torch.sigmoid(1.702 * x)


#: HF ``hidden_act`` names -> function
ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,  # erf GELU
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str, field: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}: expected one of {sorted(ACTIVATIONS)}; got {name!r}")
    return ACTIVATIONS[name]


@dataclasses.dataclass
class CLIPVisionConfig:
    """The fields of an HF ``clip_vision_model`` config that the encoder uses (defaults: CLIP ViT-B/32's)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> CLIPVisionConfig:
        # HF saves only the fields that differ from CLIPVisionConfig's defaults, so absent ones take them.
        fields = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in hf.items() if k in fields})
        if config.image_size % config.patch_size:
            raise ValueError(f"vision_config: image_size={config.image_size} is not a multiple of "
                             f"patch_size={config.patch_size}")
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"vision_config: hidden_size={config.hidden_size} is not a multiple of "
                             f"num_attention_heads={config.num_attention_heads}")
        activation(config.hidden_act, "vision_config.hidden_act")
        return config

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(config.num_channels, d, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(config.num_patches + 1, d)
        # Fixed-seed init of what the loader's random init (Linear, Embedding only) does not touch, so a
        # built-in model is the same every run; a checkpoint overwrites it.
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in (self.class_embedding, self.patch_embedding.weight):
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.02)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N, D, H/p, W/p]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, D], patches in row-major order
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [N, P + 1, D]


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's P + 1 tokens (no cache, no mask)."""

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        self.qkv_proj = MergedLinear(d, [d, d, d], ["q_proj", "k_proj", "v_proj"], bias=True)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        q, k, v = self.qkv_proj(x).view(n, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [N, H, S, Dh]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, s, -1))  # [N, S, D]


class CLIPMLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act, "vision_config.hidden_act")
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: CLIPVisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionModel(nn.Module):
    """CLIP's vision tower, returning the hidden states of ``feature_layers``.

    Hidden state ``i`` is HF's ``hidden_states[i]``: 0 is the output of
    ``pre_layrnorm``, ``i`` the output of encoder layer ``i - 1``; negative
    indices count from ``num_hidden_layers + 1``, so -1 is the last layer and
    Llava's -2 the one before it.

    Args:
        config: the vision config.
        feature_layers: indices of the hidden states :meth:`forward` returns;
            only the layers they need are built.
    """

    def __init__(self, config: CLIPVisionConfig, feature_layers: list[int]) -> None:
        super().__init__()
        self.config = config
        n = config.num_hidden_layers
        self.feature_layers = []
        for i in feature_layers:
            if not -(n + 1) <= i <= n:
                raise ValueError(f"vision_feature_layer: {i} is out of range for a vision tower of {n} layers "
                                 f"(hidden states {-(n + 1)}..{n})")
            self.feature_layers.append(i % (n + 1))
        self.num_layers = max(self.feature_layers)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, self.num_layers)

    def unused_checkpoint_names(self, prefix: str) -> list[str]:
        """Regexes of this tower's checkpoint tensors that it does not build (layers past the deepest feature
        layer, ``post_layernorm``)."""
        unused = [rf"^{re.escape(prefix)}post_layernorm\."]
        if self.num_layers < self.config.num_hidden_layers:
            skipped = "|".join(str(i) for i in range(self.num_layers, self.config.num_hidden_layers))
            unused.append(rf"^{re.escape(prefix)}encoder\.layers\.({skipped})\.")
        return unused

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, C, H, W]`` -> one ``[N, P + 1, D]`` per feature layer (CLS first)."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return [states[i] for i in self.feature_layers]

