import pytest
import torch

import ops
from dispatcher import CompilationConfig, set_compilation_config
from dispatcher import plugins
from ops import CustomOp

ALL = {"rms_norm", "gemma_rms_norm", "silu_and_mul", "gelu_and_mul", "rotary_embedding", "quant_fp8", "quant_int8"}


def test_registry():
    assert set(CustomOp.registry) == ALL
    assert CustomOp.registry["rms_norm"] is ops.RMSNorm
    assert CustomOp.registry["gemma_rms_norm"] is ops.GemmaRMSNorm
    assert ops.GemmaRMSNorm.name == "gemma_rms_norm"  # registered itself, not through RMSNorm


# (DYNAMO_ONCE_CUSTOM_OPS, level, backend) -> ops that are on
SWITCH_TABLE = [
    (None, 0, None, ALL),
    (None, 1, None, ALL),
    (None, 2, "eager", ALL),
    (None, 1, "inductor", set()),  # a backend named inductor at levels 1-2 counts as Inductor
    (None, 2, "Inductor", set()),
    (None, 0, "inductor", ALL),  # level 0 compiles nothing
    (None, 3, None, set()),
    (None, 4, None, set()),
    ("", 3, None, set()),
    ("all", 3, None, ALL),
    ("none", 0, None, set()),
    ("+rms_norm", 3, None, {"rms_norm"}),
    ("+rms_norm,+silu_and_mul", 4, None, {"rms_norm", "silu_and_mul"}),
    ("-rms_norm", 0, None, ALL - {"rms_norm"}),
    ("-rms_norm", 2, "aot_eager", ALL - {"rms_norm"}),
    ("none,+quant_fp8", 0, None, {"quant_fp8"}),
    ("all,-rotary_embedding,-quant_fp8", 3, None, ALL - {"rotary_embedding", "quant_fp8"}),
    (" all , -rms_norm ", 3, None, ALL - {"rms_norm"}),
    ("+rms_norm,all", 3, None, ALL),  # order does not matter
    ("+gemma_rms_norm", 3, None, {"gemma_rms_norm"}),
]


@pytest.mark.parametrize("env,level,backend,expected", SWITCH_TABLE)
def test_switch_from_env(monkeypatch, env, level, backend, expected):
    if env is not None:
        monkeypatch.setenv("DYNAMO_ONCE_CUSTOM_OPS", env)
    with set_compilation_config(CompilationConfig.from_env(level=level, backend=backend)):
        assert {n for n, cls in CustomOp.registry.items() if cls.enabled()} == expected
        status = ops.enabled_custom_ops()
        assert {n for n, s in status.items() if s.enabled} == expected
        assert all(s.reason for s in status.values())


@pytest.mark.parametrize("env,level,backend,expected", SWITCH_TABLE)
def test_switch_from_config(env, level, backend, expected):
    cfg = CompilationConfig(level=level, backend=backend, custom_ops=env or [])
    assert {n for n, s in ops.enabled_custom_ops(cfg).items() if s.enabled} == expected


def test_plugin_backend_counts_when_config_has_none():
    plugins.set_torch_compile_backend("inductor")
    try:
        assert not any(s.enabled for s in ops.enabled_custom_ops(CompilationConfig(level=2)).values())
        # The config's own backend wins over the plugin's.
        assert all(s.enabled for s in ops.enabled_custom_ops(CompilationConfig(level=2, backend="eager")).values())
    finally:
        plugins.set_torch_compile_backend(None)


def test_reasons():
    status = ops.enabled_custom_ops(CompilationConfig(level=3, custom_ops=["+rms_norm", "-silu_and_mul"]))
    assert status["rms_norm"] == (True, "'+rms_norm' in custom_ops")
    assert status["silu_and_mul"] == (False, "'-silu_and_mul' in custom_ops")
    assert status["quant_fp8"].reason == "default: off, level 3 (INDUCTOR) compiles with Inductor"
    assert ops.enabled_custom_ops(CompilationConfig(level=0))["quant_fp8"].reason.startswith("default: on, level 0")
    assert ops.enabled_custom_ops(CompilationConfig(level=3, custom_ops=["none"]))["rms_norm"].reason == "'none' in custom_ops"


@pytest.mark.parametrize(
    "tokens,match",
    [
        ("all,none", "exclude each other"),
        ("none,all", "exclude each other"),
        ("all,all", "'all' given twice"),
        ("none,+rms_norm,none", "'none' given twice"),
        ("+rms_norm,-rms_norm", "both enabled .'\\+'. and disabled"),
        ("-silu_and_mul,+silu_and_mul", "both enabled"),
        ("+layer_norm", "unknown op 'layer_norm'.*registered ops: gelu_and_mul, gemma_rms_norm, quant_fp8, quant_int8, rms_norm"),
        ("rms_norm", "bad token 'rms_norm'"),
        ("+", "bad token"),
        ("++rms_norm", "bad token"),
        ("+RMS_NORM", "bad token"),
        ("+rms norm", "bad token"),
        ("ALL", "bad token"),
        ("all;-rms_norm", "bad token"),
    ],
)
def test_switch_errors(monkeypatch, tokens, match):
    with pytest.raises(ValueError, match=match):
        ops.parse_custom_ops(tokens)
    with pytest.raises(ValueError, match=match):
        ops.enabled_custom_ops(CompilationConfig(level=0, custom_ops=tokens))
    monkeypatch.setenv("DYNAMO_ONCE_CUSTOM_OPS", tokens)
    with pytest.raises(ValueError, match=match):
        ops.RMSNorm.enabled()
    with pytest.raises(ValueError, match=match):
        ops.SiluAndMul()


def test_unregistered_subclass_follows_its_registered_parent():
    class MyNorm(ops.RMSNorm):
        pass

    assert MyNorm.name == "rms_norm" and "MyNorm" not in CustomOp.registry
    with set_compilation_config(CompilationConfig(level=3, custom_ops=["+rms_norm"])):
        assert MyNorm.enabled()
    with set_compilation_config(CompilationConfig(level=0, custom_ops=["-rms_norm"])):
        assert not MyNorm.enabled()
        assert MyNorm(8)._forward_method.__name__ == "forward_native"


def test_dispatch_forward_override_forces_the_choice():
    class AlwaysNative(ops.SiluAndMul):
        def dispatch_forward(self):
            return self.forward_native

    with set_compilation_config(CompilationConfig(level=0, custom_ops=["all"])):
        assert AlwaysNative()._forward_method.__name__ == "forward_native"
        expected = "forward_cuda" if torch.cuda.is_available() and ops.HAS_TRITON else "forward_cpu"
        assert ops.SiluAndMul()._forward_method.__name__ == expected


def test_choice_is_made_once_at_construction():
    with set_compilation_config(CompilationConfig(level=3)):
        m = ops.SiluAndMul()
    with set_compilation_config(CompilationConfig(level=0)):
        assert m._forward_method.__name__ == "forward_native"  # unchanged by the later config
    x = torch.randn(3, 8)
    assert torch.equal(m(x), ops.silu_and_mul_ref(x))


def test_register():
    @CustomOp.register("my_test_op")
    class MyOp(CustomOp):
        def forward_native(self, x):
            return x + 1

    try:
        assert CustomOp.registry["my_test_op"] is MyOp and MyOp.name == "my_test_op"
        with set_compilation_config(CompilationConfig(level=3, custom_ops=["+my_test_op"])):
            assert MyOp.enabled() and not ops.RMSNorm.enabled()
        assert torch.equal(MyOp()(torch.zeros(2)), torch.ones(2))
        with pytest.raises(ValueError, match="already registered"):

            @CustomOp.register("my_test_op")
            class Other(CustomOp):
                pass

        for bad in ("all", "none", "Bad", "+x", ""):
            with pytest.raises(ValueError, match="bad op name"):
                CustomOp.register(bad)
    finally:
        del CustomOp.registry["my_test_op"]


def test_unregistered_base_cannot_answer_enabled():
    class Loose(CustomOp):
        def forward_native(self, x):
            return x

    with pytest.raises(TypeError, match="not registered"):
        Loose.enabled()
