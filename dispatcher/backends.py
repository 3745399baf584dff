"""The Dynamo backend for each compilation level.

Every backend we hand to ``torch.compile`` goes through :class:`RecordingBackend`,
which counts graphs, keeps the ShapeEnv of the trace (debug mode evaluates its
guards on dispatched calls) and the FX graph (for dumps), then delegates:

- levels 1-2: ``CompilationConfig.backend``, else the plugin backend, else ``"eager"``;
- levels 3-4: the piecewise Inductor backend (``dispatcher.piecewise``), with
  the plugin and config options (level 4 forces ``max_autotune``) and the
  post-grad pass manager (``dispatcher.passes``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from . import compat, envs, plugins
from .config import CompilationConfig, CompilationLevel
from .passes import build_pass_manager, compile_context
from .passes.native_ops import acts_in_any as native_ops_acts
from .counters import compilation_counter

logger = logging.getLogger(__name__)

__all__ = ["RecordingBackend", "resolve_backend", "inductor_options"]


def inductor_options(config: CompilationConfig, level: CompilationLevel) -> dict[str, Any]:
    """Inductor config patches for a level 3-4 compile: plugin options, then the config's, then the level's;
    at levels 3-4 also the post-grad pass manager (any pass already in that option runs after ours), and Inductor's
    kernels launched with programmatic dependent launch unless ``DYNAMO_ONCE_PDL=0`` or an option above says
    otherwise (on an H100, level 3 with it took 1.9% off llama-3.2-1b's batch-1 decode step and 2.6% off
    llama-3-8b-fp8's, batch 8 within 0.6% either way: results/gemm_step_ab_inductor_pdl_{1b,8b_fp8}_h100.md)."""
    options = plugins.get_inductor_additional_configs()
    options.update(config.inductor_compile_config)
    if level >= CompilationLevel.INDUCTOR_MAX_AUTOTUNE:
        options["max_autotune"] = True
    pdl = compat.inductor_pdl_option()
    if level >= CompilationLevel.INDUCTOR and pdl is not None:
        options.setdefault(pdl, envs.pdl())
    if level >= CompilationLevel.INDUCTOR:
        option = compat.POST_GRAD_PASS_OPTION
        min_tokens = envs.sequence_parallel_min_tokens() if config.pass_config.enabled("sequence_parallel") else None
        options[option] = build_pass_manager(config.pass_config, options.get(option), min_tokens)
        if config.pass_config.enabled("native_ops"):
            _check_native_ops_sizes(config.compile_sizes)
    return options


def _check_native_ops_sizes(compile_sizes: list[int]) -> None:
    """``native_ops`` acts only in per-size compiles above its threshold: say so (a compile's backend) where none is."""
    if not native_ops_acts(compile_sizes):
        logger.warning("pass native_ops is on but changes nothing: it acts in per-size compiles of more than "
                       "DYNAMO_ONCE_NATIVE_OPS_ABOVE=%d tokens, and CompilationConfig.compile_sizes has none (%s); "
                       "add the step sizes it should serve", envs.native_ops_above(), list(compile_sizes))


def resolve_backend(config: CompilationConfig, level: CompilationLevel) -> str | Callable[..., Any]:
    """The backend that compiles a traced graph at ``level`` (before our recording wrapper)."""
    if level >= CompilationLevel.INDUCTOR:
        return "inductor"
    if config.backend is not None:
        return config.backend
    plugin = plugins.get_torch_compile_backend()
    return plugin if plugin is not None else "eager"


def _compile_with(backend: str | Callable[..., Any], gm: torch.fx.GraphModule, example_inputs: list[Any],
                  options: dict[str, Any]) -> Callable[..., Any]:
    if backend == "inductor":
        with compile_context(options):
            return compat.inductor_compile(gm, example_inputs, options)
    if isinstance(backend, str):
        return compat.lookup_backend(backend)(gm, example_inputs)
    return backend(gm, example_inputs)


class RecordingBackend:
    """A per-instance Dynamo backend that records what it compiles.

    Attributes:
        graphs: the FX graphs compiled, in order.
        shape_envs: the ShapeEnv of each trace (None for a trace without one).
    """

    def __init__(self, config: CompilationConfig, level: CompilationLevel, owner_name: str):
        self.config = config
        self.level = level
        self.owner_name = owner_name
        self.backend = resolve_backend(config, level)
        self.options = inductor_options(config, level) if self.backend == "inductor" else {}
        self.piecewise = None
        if level >= CompilationLevel.INDUCTOR:  # level 1-2 with backend="inductor": stock whole-graph Inductor
            from .piecewise import PiecewiseBackend

            self.piecewise = PiecewiseBackend(config, level, self.options, owner_name)
        self.graphs: list[torch.fx.GraphModule] = []
        self.shape_envs: list[Any] = []
        self.static_indices: list[int] = []  # of the first graph's inputs: parameters and buffers
        self.compile_s = 0.0  # seconds in __call__: the compiles of the traced graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.graphs:
            compilation_counter.add("num_recompiles")
            logger.info("%s: Dynamo traced graph #%d (a recompile)", self.owner_name, len(self.graphs) + 1)
        compilation_counter.add("num_graphs_seen")
        if not self.graphs:
            self.static_indices = [i for i, t in enumerate(example_inputs)
                                   if isinstance(t, torch.Tensor) and compat.is_static_input(t)]
        self.graphs.append(gm)
        self.shape_envs.append(compat.current_shape_env())
        t0 = time.perf_counter()
        if self.piecewise is not None:  # counts its own compilations: one per piece and size
            compiled = self.piecewise(gm, example_inputs)
        else:
            compiled = _compile_with(self.backend, gm, example_inputs, self.options)
            compilation_counter.add("num_backend_compilations")
        dt = time.perf_counter() - t0
        self.compile_s += dt
        logger.debug("%s: backend %s compiled a graph of %d nodes in %.2fs", self.owner_name,
                     getattr(self.backend, "__name__", self.backend), len(gm.graph.nodes), dt)
        return compiled

    def compile_aot(self, gm: torch.fx.GraphModule, example_inputs: list[Any], fake_args: list[Any],
                    static: list[int]) -> Callable[..., Any]:
        """Levels 3-4: compile a graph rebuilt from an AOT artifact (``dispatcher.aot``), no Dynamo trace:
        ``example_inputs`` are the first call's, ``fake_args`` the trace's fake inputs, ``static`` the indices
        of the parameters and buffers among them."""
        t0 = time.perf_counter()
        self.graphs.append(gm)
        self.static_indices = list(static)
        # As Dynamo runs a backend: outside inference mode, grad mode as the call has it.
        grad = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grad), compat.tracing_with(compat.fake_mode_of(fake_args)):
            compiled = self.piecewise(gm, example_inputs, fake_args, static)
        dt = time.perf_counter() - t0
        self.compile_s += dt
        logger.debug("%s: compiled the AOT graph of %d nodes in %.2fs", self.owner_name, len(gm.graph.nodes), dt)
        return compiled
