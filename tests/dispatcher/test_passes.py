"""The post-grad pass manager: configuration, its cache key, plugin passes, and the passes on small models.

Every compile here runs in a fresh Inductor cache: a graph loaded from the FX graph cache runs no pass.
"""

import importlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from passes_testing import EPS, FUSED, GEMMA_FUSED, HIDDEN, OpCounter, ResidualNorms, aten, level3

from dispatcher import CompilationConfig, CompilationLevel, compat, envs, plugins, set_compilation_config
from dispatcher.backends import inductor_options
from dispatcher.passes import (
    GraphPass,
    NoOpEliminationPass,
    PassConfig,
    PostGradPassManager,
    build_pass_manager,
    pass_counter,
)
from dispatcher.passes import fused_add_rms_norm as fused_module
from dispatcher.passes.manager import order_passes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh_inductor_cache():
    with compat.fresh_inductor_cache():
        yield


@pytest.fixture
def add_pass():
    """``add_pass(pass_, before=..., after=...)``: a plugin pass for the test, removed after it."""
    added = []

    def add(pass_, **anchor):
        plugins.add_post_grad_pass(pass_, **anchor)
        added.append(pass_.name)
        return pass_

    yield add
    for name in reversed(added):
        plugins.remove_post_grad_pass(name)


def run(n_layers, dtype=torch.float32, tokens=7, passes=None, config=None, **model_kw):
    """Build ``ResidualNorms`` at level 3 and run it once; returns ``(outputs, PassCounts)``."""
    torch._dynamo.reset()
    cfg = config or level3()
    if passes is not None:  # relative to every pass on, unless it says all / none itself
        cfg.pass_config = PassConfig.parse(passes if passes.startswith(("all", "none")) else ["all", passes])
    with set_compilation_config(cfg):
        torch.manual_seed(0)
        model = ResidualNorms(n_layers, **model_kw).to(dtype)
    torch.manual_seed(1)
    x = 3 * torch.randn(tokens, HIDDEN, dtype=dtype)
    with pass_counter.record() as counts:
        out = model(x)
    return out, counts


# --- configuration --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, expected", [
    ("", PassConfig()),
    ("all", PassConfig(noop=True, fused_add_rms_norm=True, rms_norm_quant=True, act_quant=True, gemm_act_quant=True,
                       quant_gemm=True, sequence_parallel=True, gated_linear=True, rope_linear=True,
                       small_m_linear=True, norm_linear=True, native_ops=True)),
    ("none", PassConfig(noop=False, fused_add_rms_norm=False, rms_norm_quant=False, act_quant=False,
                        gemm_act_quant=False, quant_gemm=False, sequence_parallel=False, gated_linear=False,
                        rope_linear=False, small_m_linear=False, norm_linear=False, native_ops=False)),
    ("none,+fused_add_rms_norm", PassConfig(noop=False, fused_add_rms_norm=True, rms_norm_quant=False,
                                            act_quant=False, gemm_act_quant=False, quant_gemm=False,
                                            sequence_parallel=False, gated_linear=False, rope_linear=False,
                                            small_m_linear=False, norm_linear=False, native_ops=False)),
    (" +fused_add_rms_norm , -noop ", PassConfig(noop=False, fused_add_rms_norm=True)),
    (["all", "-noop", "-act_quant"], PassConfig(noop=False, fused_add_rms_norm=True, rms_norm_quant=True,
                                                act_quant=False, gemm_act_quant=True, quant_gemm=True,
                                                sequence_parallel=True, gated_linear=True, rope_linear=True,
                                                small_m_linear=True, norm_linear=True, native_ops=True)),
    ("-noop", PassConfig(noop=False)),
])
def test_pass_config_parse(tokens, expected):
    assert PassConfig.parse(tokens) == expected
    assert PassConfig.parse(expected.token_string()) == expected


@pytest.mark.parametrize("tokens, message", [
    ("+fused_rms", "bad token '\\+fused_rms'"),
    ("noop", "bad token 'noop'"),
    ("all,none", "'none' after 'all'"),
    ("all,all", "'all' after 'all'"),
    ("+noop,-noop", "both enabled"),
])
def test_pass_config_errors_say_what_is_allowed(tokens, message):
    with pytest.raises(ValueError, match=message) as e:
        PassConfig.parse(tokens)
    if "both" not in message:
        assert "'all', 'none', '+name' or '-name'" in str(e.value)
        assert ("noop, fused_add_rms_norm, rms_norm_quant, act_quant, gemm_act_quant, quant_gemm, "
                "sequence_parallel, gated_linear, rope_linear, small_m_linear") in str(e.value)


def test_pass_config_from_env_and_config(monkeypatch):
    assert CompilationConfig().pass_config == PassConfig()
    monkeypatch.setenv("DYNAMO_ONCE_PASSES", "+fused_add_rms_norm,-noop")
    assert CompilationConfig.from_env().pass_config == PassConfig(noop=False, fused_add_rms_norm=True)
    assert CompilationConfig.from_env(pass_config="none").pass_config.noop is False  # overrides win
    monkeypatch.setenv("DYNAMO_ONCE_PASSES", "+fusion")
    with pytest.raises(ValueError, match=r"DYNAMO_ONCE_PASSES='\+fusion': bad token .* noop, fused_add_rms_norm, rms_norm_quant"):
        envs.passes()
    assert CompilationConfig(pass_config="all").pass_config == PassConfig.parse("+noop,+fused_add_rms_norm,"
                                                                                "+rms_norm_quant,+act_quant,"
                                                                                "+gemm_act_quant,+quant_gemm,"
                                                                                "+sequence_parallel,+gated_linear,"
                                                                                "+rope_linear,"
                                                                                "+small_m_linear,+norm_linear,"
                                                                                "+native_ops")
    with pytest.raises(ValueError, match="CompilationConfig.pass_config: bad token"):
        CompilationConfig(pass_config="fast")
    with pytest.raises(ValueError, match="CompilationConfig.pass_config: expected a PassConfig"):
        CompilationConfig(pass_config={"noop": False})
    with pytest.raises(ValueError, match="PassConfig.noop: expected True, False or None"):
        PassConfig(noop=1)


def test_manager_installed_at_levels_3_and_4_only():
    key = compat.POST_GRAD_PASS_OPTION
    for level in (CompilationLevel.INDUCTOR, CompilationLevel.INDUCTOR_MAX_AUTOTUNE):
        manager = inductor_options(CompilationConfig(pass_config="-noop,+fused_add_rms_norm"), level)[key]
        assert isinstance(manager, PostGradPassManager)
        assert [p.name for p in manager.passes] == ["fused_add_rms_norm", "gemm_act_quant", "gated_linear", "small_m_linear"]
        default = inductor_options(CompilationConfig(), level)[key]
        assert [p.name for p in default.passes] == ["gemm_act_quant", "gated_linear", "small_m_linear"]  # the passes measured faster
    assert key not in inductor_options(CompilationConfig(level=2, backend="inductor"), CompilationLevel.DYNAMO_ONCE)


# --- the cache key ----------------------------------------------------------------------------------------


def test_uuid_changes_with_the_configuration_only():
    default = build_pass_manager(PassConfig()).uuid()
    assert build_pass_manager(PassConfig()).uuid() == default  # no id() or hash() in it
    assert build_pass_manager(PassConfig(noop=False, fused_add_rms_norm=False)).uuid() == default  # the same passes
    tokens = ("+noop", "+fused_add_rms_norm", "+rms_norm_quant", "+act_quant", "all")
    others = {build_pass_manager(PassConfig.parse(t)).uuid() for t in tokens}
    assert len(others) == len(tokens) and default not in others
    manager = build_pass_manager(PassConfig())
    assert manager.for_size(8).uuid() == default  # no pass here depends on the size


def test_uuid_keeps_pdl_and_plain_kernels_apart(monkeypatch):
    """The library's ops trace to their kernels' PDL form or plain form by ``DYNAMO_ONCE_PDL``, where the graph the
    cache key is computed from holds them opaque: the key must tell the two apart."""
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "1")
    on = build_pass_manager(PassConfig()).uuid()
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    assert build_pass_manager(PassConfig()).uuid() != on


def test_uuid_is_stable_across_processes():
    code = ("import ops\nfrom dispatcher.passes import PassConfig, build_pass_manager\n"
            "print(build_pass_manager(PassConfig()).uuid())")
    env = dict(os.environ, PYTHONHASHSEED="12345")  # not ours: str hashes differ from this process's
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == build_pass_manager(PassConfig()).uuid()


_LAZY_TRACE = """
import torch
from dispatcher import compat, set_compilation_config
from dispatcher.passes import PassConfig, PatternPass, build_pass_manager, builtin_passes, pass_counter
from passes_testing import HIDDEN, ResidualNorms, level3
build_pass_manager(PassConfig.parse("all"))
print([p.num_patterns for p in builtin_passes() if isinstance(p, PatternPass)])
with compat.fresh_inductor_cache(), torch.no_grad():
    with set_compilation_config(level3()):
        model = ResidualNorms(2)
    with pass_counter.record() as counts:
        model(torch.randn(5, HIDDEN))
print([p.name for p in builtin_passes() if isinstance(p, PatternPass) and p.num_patterns], counts.matches["fused_add_rms_norm"])
"""


def test_patterns_are_traced_by_the_first_compile_not_by_the_manager():
    """Building the manager traces nothing (a start whose compiles all hit Inductor's cache never pays for the
    patterns); the first compile a pass runs in traces its patterns there, inside Inductor's compile, and matches."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "dispatcher")]),
               DYNAMO_ONCE_DISABLE_COMPILE_CACHE="1")
    out = subprocess.run([sys.executable, "-c", _LAZY_TRACE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    built, compiled = out.stdout.strip().splitlines()[-2:]
    # fused_add_rms_norm, rms_norm_quant, act_quant, gemm_act_quant, quant_gemm, gated_linear, rope_linear,
    # small_m_linear, norm_linear
    assert built == "[0, 0, 0, 0, 0, 0, 0, 0, 0]"
    # this model has no quantization and no linear of a weight the small-M op takes on the CPU: those passes ran
    # on its graphs (and traced), only fused_add_rms_norm rewrote; gemm_act_quant and quant_gemm, whose patterns all
    # hold a W8A8 GEMM, saw none in the graph and traced nothing (on by default, gemm_act_quant costs a bf16 model's
    # compile nothing)
    names, matches = compiled.rsplit(" ", 1)
    assert "fused_add_rms_norm" in names and "act_quant" in names and "gemm_act_quant" not in names
    assert "quant_gemm" not in names
    assert "norm_linear" not in names  # no linear op in the graph: its anchors, nothing traced
    assert int(matches) == 2


def test_uuid_changes_with_a_pass_source(tmp_path, monkeypatch, add_pass):
    module = tmp_path / "tmp_graph_pass.py"
    source = ("from dispatcher.passes import GraphPass\n\n\nclass TmpPass(GraphPass):\n    name = 'tmp_pass'\n\n"
              "    def __call__(self, graph, size):\n        return {}\n")
    module.write_text(source.format(0))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("tmp_graph_pass")
    before = build_pass_manager(PassConfig()).uuid()
    add_pass(mod.TmpPass())
    first = build_pass_manager(PassConfig()).uuid()
    plugins.remove_post_grad_pass("tmp_pass")
    module.write_text(source.format(123))  # another size on disk: inspect re-reads it
    mod = importlib.reload(mod)
    plugins.add_post_grad_pass(mod.TmpPass())
    second = build_pass_manager(PassConfig()).uuid()
    assert len({before, first, second}) == 3


def test_uuid_covers_op_availability_and_chained_passes(monkeypatch):
    ALL = PassConfig.parse("all")
    available = build_pass_manager(ALL).uuid()

    class Theirs(compat.custom_graph_pass_class()):
        def __init__(self, key):
            self.key = key

        def __call__(self, graph):
            pass

        def uuid(self):
            return self.key

    theirs_a, theirs_b = (build_pass_manager(ALL, Theirs(key)).uuid() for key in "ab")
    assert len({available, theirs_a, theirs_b}) == 3
    assert build_pass_manager(ALL, [Theirs(None)]).uuid() is None  # theirs not cacheable: nor are we
    with pytest.raises(ValueError, match="CustomGraphPass"):
        build_pass_manager(ALL, lambda graph: None)
    monkeypatch.setattr(fused_module, "dynamo_once_op", lambda name: None)
    assert build_pass_manager(ALL).uuid() != available


def test_cache_key_keeps_a_compile_without_passes_apart():
    """The same model compiled without passes, then with them: a miss, not the pass-free graph; then a hit."""
    hits, misses = compat.fx_graph_cache_counts()
    _, counts = run(2, passes="none")
    assert counts.matches["fused_add_rms_norm"] == 0 and compat.fx_graph_cache_counts() == (hits, misses + 1)
    _, counts = run(2)
    assert counts.matches["fused_add_rms_norm"] == 2 and compat.fx_graph_cache_counts() == (hits, misses + 2)
    _, counts = run(2)  # the fused graph, from the cache: no pass ran
    assert counts.runs["manager"] == 0 and compat.fx_graph_cache_counts() == (hits + 1, misses + 2)


# --- plugin passes -----------------------------------------------------------------------------------------


class Tagger(GraphPass):
    def __init__(self, name):
        self.name = name

    def __call__(self, graph, size):
        return 0


class NoCall(GraphPass):
    name = "no_call"


def test_add_post_grad_pass_errors(add_pass):
    with pytest.raises(ValueError, match="expected a dispatcher.passes.GraphPass instance"):
        plugins.add_post_grad_pass(lambda graph: None)
    with pytest.raises(ValueError, match="name: expected"):
        plugins.add_post_grad_pass(Tagger("Bad-Name"))
    with pytest.raises(ValueError, match="'noop' is already in use"):
        plugins.add_post_grad_pass(Tagger("noop"))
    with pytest.raises(ValueError, match="does not implement __call__"):
        plugins.add_post_grad_pass(NoCall())
    with pytest.raises(ValueError, match="not both"):
        plugins.add_post_grad_pass(Tagger("a"), before="noop", after="noop")
    with pytest.raises(ValueError, match="no pass named 'fusion' to run after; passes: noop, fused_add_rms_norm"):
        plugins.add_post_grad_pass(Tagger("a"), after="fusion")
    namespace = {"GraphPass": GraphPass}
    exec("class Interactive(GraphPass):\n    name = 'interactive'\n    def __call__(self, graph, size):\n"
         "        return 0\n", namespace)
    with pytest.raises(ValueError, match="cannot be read"):
        plugins.add_post_grad_pass(namespace["Interactive"]())
    add_pass(Tagger("a"))
    add_pass(Tagger("b"), after="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        plugins.add_post_grad_pass(Tagger("a"))
    with pytest.raises(ValueError, match="b run.* next to 'a'"):
        plugins.remove_post_grad_pass("a")
    with pytest.raises(ValueError, match="no added pass named 'noop'"):
        plugins.remove_post_grad_pass("noop")
    assert [p.name for p, _, _ in plugins.get_post_grad_passes()] == ["a", "b"]


def test_plugin_passes_run_where_they_asked(add_pass):
    for name, anchor in [("last", {}), ("first", {"before": "noop"}), ("mid1", {"after": "noop"}),
                         ("mid2", {"after": "noop"}), ("pre_fused", {"before": "fused_add_rms_norm"})]:
        add_pass(Tagger(name), **anchor)
    names = [p.name for p in build_pass_manager(PassConfig.parse("all")).passes]
    assert names == ["first", "noop", "mid1", "mid2", "pre_fused", "fused_add_rms_norm", "rms_norm_quant",
                     "act_quant", "gemm_act_quant", "quant_gemm", "sequence_parallel", "gated_linear", "rope_linear",
                     "small_m_linear", "norm_linear", "native_ops",
                     "last"]
    # the library's passes switched off keep their places as anchors; plugin passes still run
    names = [p.name for p in build_pass_manager(PassConfig.parse("none")).passes]
    assert names == ["first", "mid1", "mid2", "pre_fused", "last"]
    assert [p.name for p in order_passes([Tagger("x")], [(Tagger("y"), "x", None)])] == ["y", "x"]


class SizeGated(Tagger):
    """Runs only in the per-size compiles."""

    def __init__(self):
        super().__init__("per_size_only")
        self.sizes = []

    def is_applicable(self, size):
        return size is not None

    def __call__(self, graph, size):
        self.sizes.append(size)
        return 1


def test_per_size_compiles_see_their_size(add_pass):
    seen = add_pass(OpCounter("count_after"), after="fused_add_rms_norm")
    gated = add_pass(SizeGated())
    torch._dynamo.reset()
    with set_compilation_config(level3(compile_sizes=[4])):
        torch.manual_seed(0)
        model = ResidualNorms(2, split=True)
    with pass_counter.record() as counts:
        model(torch.randn(7, HIDDEN))
        model(torch.randn(4, HIDDEN))  # the per-size compile of each piece
        model(torch.randn(4, HIDDEN))  # compiled once, kept
    assert [size for size, _ in seen.seen] == [None] * 3 + [4] * 3  # 3 pieces, symbolic then size 4
    assert [c[FUSED] for _, c in seen.seen] == [0, 1, 1] * 2  # the first piece holds no norm
    assert counts.matches["fused_add_rms_norm"] == 4 and counts.runs["manager"] == 6
    assert gated.sizes == [4, 4, 4] and counts.skipped["per_size_only"] == 3
    assert counts.matches["per_size_only"] == 3


# --- the passes on models ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [1, 2, 4])
def test_fused_add_rms_norm_replaces_each_layers_add_and_norm(n_layers, add_pass):
    before = add_pass(OpCounter("count_before"), before="fused_add_rms_norm")
    after = add_pass(OpCounter("count_after"), after="fused_add_rms_norm")
    _, counts = run(n_layers)
    assert counts.matches["fused_add_rms_norm"] == n_layers and counts.runs["fused_add_rms_norm"] == 1
    (_, b), (_, a) = before.seen[0], after.seen[0]
    assert b[FUSED] == 0 and b[aten.rsqrt.default] == b[aten.mean.dim] == n_layers
    assert a[FUSED] == n_layers and a[aten.rsqrt.default] == a[aten.mean.dim] == a[aten.pow.Tensor_Scalar] == 0
    assert b[aten.add.Tensor] - a[aten.add.Tensor] == 2 * n_layers  # the residual add and the + eps, per layer


# fp32: the fused op (on the CPU its fp32 reference) and Inductor's code compute the same fp32 math; only the
# order of the sum over HIDDEN squares may differ, at most HIDDEN roundings of 2**-24 relative, and each
# layer adds its own: atol = n_layers * HIDDEN * 2**-24 * max|output|. The residual sums are bit-equal in the
# first layer and carry the norms' differences through the linear layers after it.
def fp32_atol(n_layers, ref):
    return n_layers * HIDDEN * 2**-24 * ref.abs().max().item()


@pytest.mark.parametrize("n_layers", [2, 4])
def test_fused_fp32_outputs_equal_unfused(n_layers):
    (fused, fused_res), counts = run(n_layers)
    (plain, plain_res), _ = run(n_layers, passes="none")
    assert counts.matches["fused_add_rms_norm"] == n_layers
    torch.testing.assert_close(fused, plain, rtol=0, atol=fp32_atol(n_layers, plain))
    torch.testing.assert_close(fused_res, plain_res, rtol=0, atol=fp32_atol(n_layers, plain_res))


def test_fused_bf16_matches_the_rounded_sum_and_norm():
    """bf16, one layer: the fused op rounds x + residual once, as the bf16 add does (bit-equal); the normed
    row is the same fp32 value (to the sum's order, above) rounded to bf16: at most one bf16 ulp apart,
    2**-7 relative."""
    (fused, fused_res), counts = run(1, torch.bfloat16)
    (plain, plain_res), _ = run(1, torch.bfloat16, passes="none")
    assert counts.matches["fused_add_rms_norm"] == 1
    assert torch.equal(fused_res, plain_res)
    torch.testing.assert_close(fused, plain, rtol=2**-7, atol=0)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("form", ["op", "opaque op", "plain bf16"])
def test_custom_op_and_gemma_forms(form, gemma, add_pass):
    """The custom op form: with Triton installed AOTAutograd decomposes it into its body (on the CPU the
    native form); kept opaque (no Triton), the op itself is matched. Gemma's norm gets Gemma's fused op."""
    after = add_pass(OpCounter("count_after"), after="fused_add_rms_norm")
    kw = dict(norm="plain", dtype=torch.bfloat16) if form == "plain bf16" else dict(norm="op")
    with compat.triton_ops_decomposed(form != "opaque op"):
        _, counts = run(2, gemma=gemma, **kw)
    assert counts.matches["fused_add_rms_norm"] == 2
    (_, a), = after.seen
    fused, other = (GEMMA_FUSED, FUSED) if gemma else (FUSED, GEMMA_FUSED)
    assert a[fused] == 2 and a[other] == 0
    assert a[torch.ops.dynamo_once.rms_norm.default] == a[torch.ops.dynamo_once.gemma_rms_norm.default] == 0


def test_noop_views_hid_the_pattern():
    """``residual.view(-1, hidden)`` between the add and the norm: with Inductor's own no-op removal off
    (``pattern_matcher=False``), only the noop pass makes the fusion possible."""
    cfg = {"inductor_compile_config": {"pattern_matcher": False}}
    _, counts = run(2, view=True, config=level3(**cfg))
    assert counts.matches["noop"] == 2 and counts.matches["fused_add_rms_norm"] == 2
    _, counts = run(2, view=True, config=level3(**cfg), passes="-noop")
    assert counts.matches["fused_add_rms_norm"] == 0 and counts.runs["noop"] == 0


def test_noop_pass_removes_same_shape_views_only():
    def fn(x):
        a = torch.ops.aten._unsafe_view(x, [x.shape[0], 8])
        b = a.reshape(x.shape[0], 8)[:, :8].expand(x.shape[0], 8)
        return b.view(-1, 4) * 2, x[1:] + 1  # a real reshape and a real slice stay

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(6, 8))
    views = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert NoOpEliminationPass()(gm.graph, None) == 4
    left = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert len(views) - len(left) == 4 and aten.view.default in left and aten.slice.Tensor in left
    gm.recompile()
    x = torch.randn(5, 8)
    for got, want in zip(gm(x), fn(x)):
        torch.testing.assert_close(got, want)


def test_pass_without_its_ops_is_skipped(monkeypatch, caplog):
    monkeypatch.setattr(fused_module, "dynamo_once_op", lambda name: None)
    gm = compat.trace_inference_graph(lambda x, r, w: (x + r) * w, [torch.randn(2, 4), torch.randn(2, 4),
                                                                    torch.randn(4)])
    with caplog.at_level(logging.DEBUG, logger="dispatcher.passes.manager"), pass_counter.record() as counts:
        build_pass_manager(PassConfig.parse("all"))(gm.graph)
    assert counts.skipped["fused_add_rms_norm"] == 1 and counts.runs["noop"] == 1
    assert "pass fused_add_rms_norm skipped at size None: unavailable" in caplog.text


class FusedEps(Tagger):
    def __init__(self):
        super().__init__("fused_eps")
        self.eps = []

    def __call__(self, graph, size):
        self.eps += [n.args[3] for n in graph.nodes if n.target is FUSED]
        return 0


def test_eps_reaches_the_fused_op(add_pass):
    seen = add_pass(FusedEps(), after="fused_add_rms_norm")
    run(2)
    assert seen.eps == [EPS, EPS] and EPS != fused_module.EPS_STAND_IN  # the model's, not the traced stand-in


def test_fused_add_rms_norm_refuses_broadcast_and_promotion():
    """The fused op adds two same-shape, same-dtype rows: a broadcast bias or a promoting add stays apart."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dispatcher.passes import FusedAddRMSNormPass
    from passes_testing import plain_rms_norm

    def fn(x, residual, weight):
        h = x + residual
        return plain_rms_norm(h, weight, EPS), h

    fused = FusedAddRMSNormPass()
    w = torch.randn(HIDDEN)
    rows = torch.randn(5, HIDDEN)
    # a bf16 x plus an fp32 residual is an fp32 sum: the fp32 pattern's shape, but not the fused op's rounding
    for x, residual, expected in [(rows, rows, 1), (rows, torch.randn(HIDDEN), 0), (rows.bfloat16(), rows, 0)]:
        gm = make_fx(fn, tracing_mode="symbolic")(x, residual, w)
        assert fused(gm.graph, None) == expected


def test_native_forms_registry_errors():
    from dispatcher.passes.native_forms import native_form, register_native_form

    with pytest.raises(ValueError, match="fn must be callable"):
        register_native_form("some_op", 3)
    form = native_form("silu_and_mul")  # registered by ops on import
    assert form is not None
    register_native_form("silu_and_mul", form)  # the same form again: allowed
    with pytest.raises(ValueError, match="already has a native form"):
        register_native_form("silu_and_mul", lambda x: x)


def _per_token_int8(y, dim=-1, min_scale=None):
    from ops.quant_int8 import INT8_MIN_SCALE

    amax = y.abs().amax(dim=dim, keepdim=True).float()
    scale = (amax / torch.full_like(amax, 127.0)).clamp(min=INT8_MIN_SCALE if min_scale is None else min_scale)
    return torch.round(y.float() / scale).clamp(-128.0, 127.0).to(torch.int8).contiguous(), scale


@pytest.mark.parametrize("form, dtype, matches", [({}, torch.bfloat16, 1), ({}, torch.float32, 1),
                                                  ({}, torch.float64, 0), ({"dim": 0}, torch.bfloat16, 0),
                                                  ({"min_scale": 1e-10}, torch.bfloat16, 0)])
def test_native_act_quant_matches_the_library_form_only(form, dtype, matches):
    """The native per-token form (``ops.quant_int8``'s reference after SiLU-and-mul's) becomes the fused op, on
    the inputs it takes; a quantization that differs from it, per column (amax over the tokens) or with another
    minimum scale, stays, as does an fp64 input (which the fused op refuses)."""
    from dispatcher.passes import ActQuantPass
    from ops.silu_and_mul import silu_and_mul_ref

    gm = compat.trace_inference_graph(lambda x: _per_token_int8(silu_and_mul_ref(x), **form),
                                      [torch.randn(6, 32, dtype=dtype)])
    assert ActQuantPass()(gm.graph, None) == matches
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.dynamo_once.act_and_mul_dynamic_quant.default]
    assert len(fused) == matches
