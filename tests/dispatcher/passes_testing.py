"""Small level-3 models with residual adds and RMSNorms written apart, and a pass that counts a graph's ops."""

import collections

import torch
from piecewise_testing import mix  # noqa: F401  (registers dynamo_once_test::mix, the stand-in splitting op)

import ops  # noqa: F401  (registers torch.ops.dynamo_once.*)
from dispatcher import CompilationConfig, support_torch_compile
from dispatcher.passes import GraphPass

HIDDEN = 32
EPS = 1e-5
aten = torch.ops.aten
FUSED = torch.ops.dynamo_once.fused_add_rms_norm.default
GEMMA_FUSED = torch.ops.dynamo_once.gemma_fused_add_rms_norm.default


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm as plain model code writes it, in the library's convention: fp32 math, cast back once."""
    xf = x.float()
    w = 1.0 + weight.float() if gemma else weight.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


@support_torch_compile
class ResidualNorms(torch.nn.Module):
    """``n_layers`` x (``residual = linear(hidden) + residual; hidden = norm(residual)``), add and norm apart.

    Args:
        norm: ``"plain"`` (plain torch) or ``"op"`` (``torch.ops.dynamo_once.rms_norm`` / ``gemma_rms_norm``).
        gemma: Gemma's norm, ``x_normed * (1 + weight)``.
        split: a splitting op (``dynamo_once_test::mix``) after each linear: one more piece a layer.
        view: the sum goes through ``view(-1, hidden)`` (a view to the shape it has) before the norm.
    """

    def __init__(self, n_layers: int, norm: str = "plain", gemma: bool = False, split: bool = False,
                 view: bool = False):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(n_layers))
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(0.1 * torch.randn(HIDDEN) + (0.0 if gemma else 1.0)) for _ in range(n_layers))
        self.norm, self.gemma, self.split, self.view = norm, gemma, split, view

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.norm == "op":
            op = torch.ops.dynamo_once.gemma_rms_norm if self.gemma else torch.ops.dynamo_once.rms_norm
            return op(x, weight, EPS)
        return plain_rms_norm(x, weight, EPS, self.gemma)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden = x
        for lin, weight in zip(self.lins, self.weights):
            out = lin(hidden)
            if self.split:
                out = torch.ops.dynamo_once_test.mix(out)
            residual = out + residual
            if self.view:
                residual = residual.view(-1, HIDDEN)
            hidden = self.rms_norm(residual, weight)
        return hidden, residual


def level3(**kw) -> CompilationConfig:
    """Level 3 with every library pass on (``fused_add_rms_norm`` is off by default until measured)."""
    kw.setdefault("use_cudagraph", False)
    kw.setdefault("pass_config", "all")
    return CompilationConfig(level=3, splitting_ops=["dynamo_once_test::mix"], **kw)


class OpCounter(GraphPass):
    """Counts the call targets of each graph it sees: ``seen`` is a list of ``(size, Counter)``."""

    def __init__(self, name: str):
        self.name = name
        self.seen: list[tuple[int | None, collections.Counter]] = []

    def __call__(self, graph: torch.fx.Graph, size: int | None) -> int:
        self.seen.append((size, collections.Counter(n.target for n in graph.nodes if n.op == "call_function")))
        return 0

    def total(self, target) -> int:
        return sum(counts[target] for _, counts in self.seen)
