"""Compilation levels and the process-wide compilation config."""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Callable

from . import envs
from .levels import CompilationLevel
from .passes.pass_config import PassConfig

__all__ = [
    "CompilationLevel",
    "CompilationConfig",
    "PassConfig",
    "default_capture_sizes",
    "get_compilation_config",
    "set_compilation_config",
]


def default_capture_sizes(largest: int = 512) -> list[int]:
    """CUDA-graph capture sizes up to ``largest`` tokens: 1, 2, 4, every 8 to 256, then every 16. A ``models.LLM``
    step of at most ``max_num_tokens`` (512 by default) then replays its pieces' graphs at every size: a chunked
    prefill's steps of a 512-token chunk ran their pieces' code past 256, 18% slower a mixed step on an H100
    (``benchmarks/results/chunked_prefill_eager_warm_after_1b_cap512_h100.md``: 4.18 ms against 5.104)."""
    return [n for n in [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, largest + 1, 16)) if n <= largest]


@dataclasses.dataclass
class CompilationConfig:
    """What a decorated model does on its first call, and how later calls are dispatched.

    Args:
        level: see :class:`CompilationLevel`.
        backend: Dynamo backend for levels 1-2 (a name or a callable); ``None`` means
            the plugin backend (``dispatcher.plugins``), else ``"eager"``. Levels 3-4
            always use Inductor.
        custom_ops: the per-op switch, tokens like ``"all"``, ``"none"``, ``"+rms_norm"``,
            ``"-silu_and_mul"`` (validated by ``ops.custom_op``).
        use_bytecode_hook: levels >= 2: run the bytecode Dynamo produced directly
            (True) or stay inside Dynamo with every guard dropped (False).
        check_inputs: levels >= 2: compare every tensor argument's rank, dtype,
            device and static sizes with the traced ones on each call.
        debug: also evaluate the trace's shape guards on each call and raise on
            a failing one (``DYNAMO_ONCE_DEBUG``).
        inductor_compile_config: Inductor options for levels 3-4, merged over
            ``plugins.get_inductor_additional_configs()``.
        debug_dump_path: write disassembly, decompiled source and FX graph of
            each captured code here.
        fullgraph: levels >= 2 require one graph; a graph break is an error.
        splitting_ops: levels 3-4 split the graph at calls of these ops (``"namespace::name"``);
            they run eagerly between the compiled pieces.
        compile_sizes: levels 3-4 also compile each piece for these exact token counts.
        cudagraph_capture_sizes: the token counts a caller (``models.LLM``) captures with
            ``dispatcher.CUDAGraphs.capture`` (one graph per piece per size, or one per whole step).
            Nothing is captured unless a caller asks: graphs are explicit. Default:
            :func:`default_capture_sizes` (1, 2, 4, every 8 to 256, every 16 to 512).
        use_cudagraph: allow CUDA graphs of the pieces at levels 3-4 (default: when CUDA is available).
        cudagraph_mode: ``"none"``, ``"piecewise"`` or ``"full_and_piecewise"``: which modes the
            runner captures (the latter also whole decode steps, attention included; default on CUDA).
        pass_config: levels 3-4: which of the library's post-grad graph passes run in every Inductor
            compile (``dispatcher.passes``); a :class:`PassConfig` or its switch tokens, e.g.
            ``"+fused_add_rms_norm,-noop"``, ``"all"``, ``"none"`` (``DYNAMO_ONCE_PASSES``).
    """

    level: CompilationLevel = CompilationLevel.INDUCTOR
    backend: str | Callable[..., Any] | None = None
    custom_ops: list[str] = dataclasses.field(default_factory=list)
    use_bytecode_hook: bool = True
    check_inputs: bool = True
    debug: bool = False
    inductor_compile_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    debug_dump_path: str | None = None
    fullgraph: bool = True
    splitting_ops: list[str] = dataclasses.field(default_factory=lambda: ["dynamo_once::attention"])
    compile_sizes: list[int] = dataclasses.field(default_factory=list)
    cudagraph_capture_sizes: list[int] = dataclasses.field(default_factory=lambda: default_capture_sizes())
    use_cudagraph: bool | None = None
    cudagraph_mode: str | None = None
    pass_config: PassConfig = dataclasses.field(default_factory=PassConfig)

    def __post_init__(self) -> None:
        try:
            self.level = CompilationLevel.parse(self.level)
        except ValueError as e:
            raise ValueError(f"CompilationConfig.level: {e}") from None
        if self.backend is not None and not (isinstance(self.backend, str) or callable(self.backend)):
            raise ValueError(
                f"CompilationConfig.backend: expected a backend name, a callable or None; "
                f"got {self.backend!r} ({type(self.backend).__name__})"
            )
        if isinstance(self.custom_ops, str):
            self.custom_ops = [t.strip() for t in self.custom_ops.split(",") if t.strip()]
        if not isinstance(self.custom_ops, (list, tuple)) or not all(isinstance(t, str) for t in self.custom_ops):
            raise ValueError(f"CompilationConfig.custom_ops: expected a list of str; got {self.custom_ops!r}")
        self.custom_ops = list(self.custom_ops)
        if not isinstance(self.inductor_compile_config, dict):
            raise ValueError(
                "CompilationConfig.inductor_compile_config: expected a dict; "
                f"got {type(self.inductor_compile_config).__name__}"
            )
        v = self.splitting_ops
        if not isinstance(v, (list, tuple)) or not all(isinstance(t, str) and "::" in t for t in v):
            raise ValueError(f"CompilationConfig.splitting_ops: expected a list of 'namespace::op' names; got {v!r}")
        self.splitting_ops = list(v)
        for name in ("compile_sizes", "cudagraph_capture_sizes"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v):
                raise ValueError(f"CompilationConfig.{name}: expected a list of positive ints; got {v!r}")
            setattr(self, name, sorted(set(v)))
        if self.use_cudagraph is None:
            import torch

            self.use_cudagraph = torch.cuda.is_available()
        if self.cudagraph_mode is None:
            self.cudagraph_mode = "full_and_piecewise" if self.use_cudagraph else "none"
        modes = ("none", "piecewise", "full_and_piecewise")
        if self.cudagraph_mode not in modes:
            raise ValueError(f"CompilationConfig.cudagraph_mode: expected one of {modes}; got {self.cudagraph_mode!r}")
        if not self.use_cudagraph:
            self.cudagraph_mode = "none"
        if isinstance(self.pass_config, (str, list, tuple)):
            try:
                self.pass_config = PassConfig.parse(self.pass_config)
            except ValueError as e:
                raise ValueError(f"CompilationConfig.pass_config: {e}") from None
        if not isinstance(self.pass_config, PassConfig):
            raise ValueError(f"CompilationConfig.pass_config: expected a PassConfig or switch tokens; "
                             f"got {self.pass_config!r}")
        for name in ("use_bytecode_hook", "check_inputs", "debug", "fullgraph", "use_cudagraph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CompilationConfig.{name}: expected a bool; got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> CompilationConfig:
        """A config from the ``DYNAMO_ONCE_*`` variables; ``overrides`` win over them.

        ``TORCH_COMPILE_DISABLE=1`` forces level 0, as it disables torch.compile.
        """
        kwargs: dict[str, Any] = {}
        level = envs.compile_level()
        if level is not None:
            kwargs["level"] = level
        if envs.torch_compile_disabled():
            kwargs["level"] = CompilationLevel.NO_COMPILATION
        ops = envs.custom_ops()
        if ops is not None:
            kwargs["custom_ops"] = ops
        kwargs["use_bytecode_hook"] = envs.use_bytecode_hook()
        kwargs["debug"] = envs.debug()
        kwargs["debug_dump_path"] = envs.debug_dump_path()
        passes = envs.passes()
        if passes is not None:
            kwargs["pass_config"] = passes
        sizes = envs.compile_sizes()
        if sizes is not None:
            kwargs["compile_sizes"] = sizes
        kwargs.update(overrides)
        return cls(**kwargs)

    def copy(self) -> CompilationConfig:
        return copy.deepcopy(self)


_lock = threading.Lock()
_current: CompilationConfig | None = None


def get_compilation_config() -> CompilationConfig:
    """The config set by :func:`set_compilation_config`, else one read from the environment.

    With none set, the environment is read on every call, so a changed
    ``DYNAMO_ONCE_*`` variable applies to the next model constructed.
    """
    cfg = _current
    return cfg if cfg is not None else CompilationConfig.from_env()


class _ConfigScope:
    """Returned by :func:`set_compilation_config`; as a context manager it restores the previous config."""

    def __init__(self, config: CompilationConfig | None, previous: CompilationConfig | None):
        self.config = config
        self.previous = previous

    def __enter__(self) -> CompilationConfig:
        return get_compilation_config()

    def __exit__(self, *exc: object) -> None:
        global _current
        with _lock:
            _current = self.previous


def set_compilation_config(config: CompilationConfig | None) -> _ConfigScope:
    """Set the process-wide config (``None``: back to the environment).

    Takes effect at once; used as ``with set_compilation_config(cfg): ...`` the
    previous config is restored on exit.
    """
    global _current
    if config is not None and not isinstance(config, CompilationConfig):
        raise TypeError(f"set_compilation_config: expected a CompilationConfig or None; got {type(config).__name__}")
    with _lock:
        previous = _current
        _current = config
    return _ConfigScope(config, previous)
