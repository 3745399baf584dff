"""Small level-3 models for the piecewise and CUDA-graph tests: a stand-in splitting op and models around it."""

import torch

from dispatcher import CompilationConfig, support_torch_compile


# A stand-in for attention: opaque to Dynamo and Inductor, so it is a split point.
@torch.library.custom_op("dynamo_once_test::mix", mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) / (1 + torch.arange(x.shape[0], device=x.device, dtype=x.dtype))[:, None]


@mix.register_fake
def _(x):
    return torch.empty_like(x)


N_LAYERS = 3
PIECES = 2 * N_LAYERS + 1  # piece, mix, piece, mix, piece, mix, piece
CAPTURABLE = N_LAYERS + 1  # the pieces between (and around) the splitting ops
DISTINCT = 2  # relu(linear(x)) before each mix (one compile for all N_LAYERS) and the last linear


@support_torch_compile
class Toy(torch.nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(N_LAYERS))
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.ops.dynamo_once_test.mix(torch.relu(layer(x)))
        return self.out(x)


def eager(m, x):
    for layer in m.layers:
        x = mix(torch.relu(layer(x)))
    return m.out(x)


@support_torch_compile
class TwoSizes(torch.nn.Module):
    """Two tensor arguments with independent dynamic dims (dim 0 of each): two dynamic sizes."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.ops.dynamo_once_test.mix(torch.relu(self.lin(x))) + self.lin(y).sum(0)


def two_sizes_eager(m, x, y):
    return mix(torch.relu(m.lin(x))) + m.lin(y).sum(0)


def config(**kw):
    kw.setdefault("use_cudagraph", False)
    return CompilationConfig(level=3, splitting_ops=["dynamo_once_test::mix"], **kw)
