import pytest

import dispatcher
from dispatcher import CompilationConfig, CompilationLevel, envs, plugins
from dispatcher.backends import inductor_options, resolve_backend
from dispatcher.passes import PostGradPassManager


@pytest.mark.parametrize(
    "value, expected",
    [("0", 0), ("4", 4), ("dynamo_once", 2), ("INDUCTOR", 3), (" Dynamo_As_Is ", 1), ("inductor_max_autotune", 4)],
)
def test_level_from_env(monkeypatch, value, expected):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", value)
    assert CompilationConfig.from_env().level == expected
    assert isinstance(CompilationConfig.from_env().level, CompilationLevel)


@pytest.mark.parametrize("value", ["5", "-1", "fast", "2.0"])
def test_bad_level_names_variable_value_and_allowed(monkeypatch, value):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", value)
    with pytest.raises(ValueError) as e:
        CompilationConfig.from_env()
    msg = str(e.value)
    assert "DYNAMO_ONCE_COMPILE_LEVEL" in msg and repr(value) in msg and "DYNAMO_ONCE" in msg and "0" in msg


@pytest.mark.parametrize("var", ["DYNAMO_ONCE_USE_BYTECODE_HOOK", "DYNAMO_ONCE_DEBUG", "TORCH_COMPILE_DISABLE"])
def test_bad_bool_names_variable(monkeypatch, var):
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=rf"{var}='maybe'.*0, 1"):
        CompilationConfig.from_env()


def test_env_fields(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNAMO_ONCE_CUSTOM_OPS", "+rms_norm, -silu_and_mul")
    monkeypatch.setenv("DYNAMO_ONCE_USE_BYTECODE_HOOK", "0")
    monkeypatch.setenv("DYNAMO_ONCE_DEBUG", "1")
    monkeypatch.setenv("DYNAMO_ONCE_DEBUG_DUMP_PATH", str(tmp_path))
    cfg = CompilationConfig.from_env()
    assert cfg.custom_ops == ["+rms_norm", "-silu_and_mul"]
    assert cfg.use_bytecode_hook is False and cfg.debug is True and cfg.debug_dump_path == str(tmp_path)


def test_defaults():
    cfg = CompilationConfig()
    assert cfg.level is CompilationLevel.INDUCTOR
    assert cfg.backend is None and cfg.custom_ops == [] and cfg.use_bytecode_hook and cfg.check_inputs
    assert not cfg.debug and cfg.inductor_compile_config == {} and cfg.debug_dump_path is None


def test_torch_compile_disable_means_level_0(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", "3")
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert CompilationConfig.from_env().level is CompilationLevel.NO_COMPILATION


def test_levels_have_docstrings():
    assert [int(m) for m in CompilationLevel] == [0, 1, 2, 3, 4]
    for member in CompilationLevel:
        assert member.__doc__ and member.__doc__ != CompilationLevel.__doc__


@pytest.mark.parametrize(
    "kwargs, field",
    [({"level": 7}, "level"), ({"backend": 3}, "backend"), ({"custom_ops": [1]}, "custom_ops"),
     ({"debug": "yes"}, "debug"), ({"inductor_compile_config": []}, "inductor_compile_config")],
)
def test_bad_config_field_is_named(kwargs, field):
    with pytest.raises(ValueError, match=f"CompilationConfig.{field}"):
        CompilationConfig(**kwargs)


def test_set_config_process_wide_and_as_context_manager(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", "1")
    assert dispatcher.get_compilation_config().level == 1
    outer = CompilationConfig(level=2)
    dispatcher.set_compilation_config(outer)
    assert dispatcher.get_compilation_config() is outer
    with dispatcher.set_compilation_config(CompilationConfig(level=0)) as inner:
        assert inner.level == 0 and dispatcher.get_compilation_config() is inner
    assert dispatcher.get_compilation_config() is outer
    dispatcher.set_compilation_config(None)
    assert dispatcher.get_compilation_config().level == 1  # back to the environment
    with pytest.raises(TypeError, match="CompilationConfig"):
        dispatcher.set_compilation_config({"level": 2})


def test_plugins_and_backend_resolution():
    try:
        cfg = CompilationConfig()
        assert resolve_backend(cfg, CompilationLevel.DYNAMO_ONCE) == "eager"
        plugins.set_torch_compile_backend("aot_eager")
        assert plugins.get_torch_compile_backend() == "aot_eager"
        assert resolve_backend(cfg, CompilationLevel.DYNAMO_AS_IS) == "aot_eager"
        assert resolve_backend(CompilationConfig(backend="eager"), CompilationLevel.DYNAMO_ONCE) == "eager"
        assert resolve_backend(cfg, CompilationLevel.INDUCTOR) == "inductor"
        plugins.set_inductor_additional_configs({"epilogue_fusion": False})
        opts = inductor_options(CompilationConfig(inductor_compile_config={"fx_graph_cache": False}),
                                CompilationLevel.INDUCTOR_MAX_AUTOTUNE)
        assert isinstance(opts.pop("post_grad_custom_post_pass"), PostGradPassManager)  # levels 3-4
        assert opts.pop("triton.enable_pdl", True) is True  # Inductor's kernels with PDL (where torch has it)
        assert opts == {"epilogue_fusion": False, "fx_graph_cache": False, "max_autotune": True}
        assert "max_autotune" not in inductor_options(cfg, CompilationLevel.INDUCTOR)
        with pytest.raises(ValueError, match="backend"):
            plugins.set_torch_compile_backend(42)
        with pytest.raises(ValueError, match="dict"):
            plugins.set_inductor_additional_configs([("a", 1)])
    finally:
        plugins.set_torch_compile_backend(None)
        plugins.set_inductor_additional_configs({})


def test_env_var_table_lists_every_variable():
    assert set(envs.ENV_VARS) == {
        "DYNAMO_ONCE_COMPILE_LEVEL", "DYNAMO_ONCE_CUSTOM_OPS", "DYNAMO_ONCE_USE_BYTECODE_HOOK",
        "DYNAMO_ONCE_DEBUG", "DYNAMO_ONCE_DEBUG_DUMP_PATH", "DYNAMO_ONCE_PDL", "DYNAMO_ONCE_PASSES",
        "DYNAMO_ONCE_SMALL_M_GEMM", "DYNAMO_ONCE_FP8_FAST_ACCUM", "DYNAMO_ONCE_PREFILL_WRITES_KV",
        "DYNAMO_ONCE_UNIFIED_ATTENTION", "DYNAMO_ONCE_MIXED_DECODE_FUSED",
        "DYNAMO_ONCE_WARM_ATTENTION", "DYNAMO_ONCE_CACHE_DIR", "DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "DYNAMO_ONCE_AOT",
        "DYNAMO_ONCE_API_KEY", "DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE", "DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS",
        "DYNAMO_ONCE_ASYNC_TP", "DYNAMO_ONCE_NATIVE_OPS_ABOVE", "DYNAMO_ONCE_COMPILE_SIZES",
    }


@pytest.mark.parametrize("value,sizes", [("128,256", [128, 256]), (" 256, 128 ,128", [128, 256]), ("", [])])
def test_compile_sizes_from_the_environment(monkeypatch, value, sizes):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_SIZES", value)
    assert CompilationConfig.from_env().compile_sizes == sizes
    assert CompilationConfig.from_env(compile_sizes=[8]).compile_sizes == [8]  # an argument wins


@pytest.mark.parametrize("value", ["0", "128,", "12.5", "-4", "big"])
def test_bad_compile_sizes_in_the_environment_name_the_variable(monkeypatch, value):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_SIZES", value)
    with pytest.raises(ValueError, match=r"DYNAMO_ONCE_COMPILE_SIZES=.*expected comma-separated positive integers"):
        CompilationConfig.from_env()


def test_levels_3_4_launch_inductors_kernels_with_pdl_unless_told_otherwise(monkeypatch):
    """Inductor's own Triton kernels launch with programmatic dependent launch at levels 3-4 (as the library's
    kernels do); ``DYNAMO_ONCE_PDL=0`` or the config's ``inductor_compile_config`` turns it off; levels 1-2 with
    ``backend="inductor"`` are stock Inductor."""
    from dispatcher import compat
    from dispatcher.backends import inductor_options

    key = compat.inductor_pdl_option()
    if key is None:
        pytest.skip("this torch's Inductor has no PDL option")
    assert inductor_options(CompilationConfig(), CompilationLevel.INDUCTOR)[key] is True
    assert inductor_options(CompilationConfig(inductor_compile_config={key: False}), CompilationLevel.INDUCTOR)[key] \
        is False
    assert key not in inductor_options(CompilationConfig(), CompilationLevel.DYNAMO_ONCE)
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    assert inductor_options(CompilationConfig(), CompilationLevel.INDUCTOR)[key] is False
