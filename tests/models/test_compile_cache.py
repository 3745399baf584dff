"""The compile cache (levels 3-4): a second process starts warm, equal outputs; a corrupt file; two processes at
once; what changes the key; the off switch; ``dynamo-once cache``.

Each process gets its own ``DYNAMO_ONCE_CACHE_DIR`` and a fresh ``TORCHINDUCTOR_CACHE_DIR``, so that a warm
start comes from our cache only, not from Inductor's own on-disk cache of an earlier process.
"""

import hashlib
import importlib
import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch

from dispatcher import CompilationConfig, TorchCompileWrapperWithCustomDispatcher, compile_cache, set_compilation_config
from dispatcher.counters import compilation_counter
from models.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6]]

# One start of tiny-llama at level 3 (no CUDA graphs, 16 tokens a step); prints what the tests compare.
SCRIPT = """
import json, sys, torch
from dispatcher import CompilationConfig, TorchCompileWrapperWithCustomDispatcher, compat
from models import LLM

llm = LLM("tiny-llama", max_num_tokens=16, device="cpu",
          compilation_config=CompilationConfig(level=3, use_cudagraph=False))
hits, misses = compat.fx_graph_cache_counts()
logits = []
def choose(seqs, step_logits):
    logits.append(step_logits[0].tolist())
    return [int(step_logits[0].argmax())]
tokens = llm.run(PROMPT, 2, choose)
(compiled,) = [m for m in llm.model.modules() if isinstance(m, TorchCompileWrapperWithCustomDispatcher)]
entry = compiled.compile_cache
from dispatcher.counters import compilation_counter
from torch._dynamo.utils import counters
print("RESULT " + json.dumps({
    "hits": hits, "misses": misses, "tokens": tokens, "logits": logits,
    "status": llm.startup.compile_cache, "writes": entry.writes if entry else 0,
    "path": str(entry.path) if entry else None, "startup": llm.startup.format(),
    "aot": compiled.aot_status, "trace": llm.startup.trace, "aot_loads": compilation_counter.num_aot_loads,
    "traced": compilation_counter.num_graphs_seen, "dynamo_graphs": counters["stats"]["unique_graphs"],
    "aot_autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}))
""".replace("PROMPT", repr(PROMPT))


def _env(cache: pathlib.Path, inductor: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYNAMO_ONCE_", "TORCHINDUCTOR_"))}
    env.update(DYNAMO_ONCE_CACHE_DIR=str(cache), TORCHINDUCTOR_CACHE_DIR=str(inductor), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), **extra)
    return env


def _start(cache: pathlib.Path, inductor: pathlib.Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(cache, inductor, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return {**json.loads(line[len("RESULT "):]), "stderr": err}


def _run(cache: pathlib.Path, inductor: pathlib.Path, **extra: str) -> dict:
    return _result(_start(cache, inductor, **extra))


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A first start on an empty cache: it compiles and writes the entry."""
    tmp = tmp_path_factory.mktemp("cold")
    result = _run(tmp / "cache", tmp / "inductor")
    assert result["status"] == "miss" and result["misses"] > 0 and result["writes"] == 1
    assert result["aot"] == "saved" and result["traced"] == 1 and result["trace"] == "dynamo"
    assert pathlib.Path(result["path"]).with_suffix(".aot").is_file()
    return tmp / "cache", result


def test_second_process_loads_from_the_cache(cold, tmp_path):
    cache, first = cold
    second = _run(cache, tmp_path / "inductor")  # an empty Inductor cache: only ours can make it warm
    assert second["status"] == "hit"
    assert second["misses"] == 0  # no Inductor compile: every piece is an FX-graph-cache hit
    assert second["hits"] == first["hits"] + first["misses"]  # the same lookups, all hits
    assert second["writes"] == 0  # nothing new to write
    assert second["logits"] == first["logits"] and second["tokens"] == first["tokens"]
    assert "compile" in second["startup"] and "cache hit" in second["startup"]
    # The AOT forward: no Dynamo trace at all (our backend saw no traced graph, Dynamo made none).
    assert second["aot"] == "loaded" and second["aot_loads"] == 1
    assert second["traced"] == 0 and second["dynamo_graphs"] == 0
    assert second["aot_autograd_misses"] == 0  # the rebuilt graph's pieces hit AOTAutograd's cache as a trace's do
    assert second["trace"] == "aot" and "trace" in second["startup"] and "AOT forward loaded" in second["startup"]


def test_corrupt_entry_is_a_warning_and_a_recompile_that_rewrites_it(cold, tmp_path):
    cache, first = cold
    path = pathlib.Path(first["path"])
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    try:
        result = _run(cache, tmp_path / "inductor")
        assert "unusable" in result["stderr"] and "truncated" in result["stderr"]
        assert result["status"] == "corrupt" and result["misses"] > 0 and result["writes"] == 1
        assert result["logits"] == first["logits"]
        assert path.stat().st_size > len(good) // 2
        again = _run(cache, tmp_path / "inductor2")  # the rewritten file loads
        assert again["status"] == "hit" and again["misses"] == 0 and again["logits"] == first["logits"]
    finally:
        path.write_bytes(good)


def _aot_copy(cold, tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of the cold start's cache entry (both files) under ``tmp_path``; returns (cache dir, its .aot)."""
    _, first = cold
    src = pathlib.Path(first["path"])
    mine = tmp_path / "cache" / "compile"
    mine.mkdir(parents=True)
    for suffix in (".bin", ".aot"):
        (mine / src.with_suffix(suffix).name).write_bytes(src.with_suffix(suffix).read_bytes())
    return tmp_path / "cache", mine / src.with_suffix(".aot").name


def test_corrupt_aot_artifact_is_a_warning_and_a_retrace_that_rewrites_it(cold, tmp_path):
    _, first = cold
    cache, aot = _aot_copy(cold, tmp_path)
    good = aot.read_bytes()
    aot.write_bytes(good[: len(good) // 2])  # truncated
    result = _run(cache, tmp_path / "inductor")
    assert "AOT forward" in result["stderr"] and "unusable" in result["stderr"], result["stderr"][-3000:]
    assert "truncated" in result["stderr"]
    assert result["aot"] == "saved" and result["traced"] == 1 and result["trace"] == "dynamo"
    assert result["status"] == "hit" and result["misses"] == 0  # Inductor's artifacts still load: no compile
    assert result["logits"] == first["logits"]
    assert aot.stat().st_size > len(good) // 2  # rewritten
    again = _run(cache, tmp_path / "inductor2")
    assert again["aot"] == "loaded" and again["traced"] == 0 and again["logits"] == first["logits"]


def test_aot_artifact_with_a_bad_payload_is_a_warning_and_a_retrace(cold, tmp_path):
    _, first = cold
    cache, aot = _aot_copy(cold, tmp_path)
    header = compile_cache.read_header(aot)
    payload = pickle.dumps({"format": 1, "code": b"not bytecode"})  # intact file, not an artifact this code can use
    header.update(payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    compile_cache.write_atomic(aot, compile_cache._encode(header, payload))
    result = _run(cache, tmp_path / "inductor")
    assert "AOT forward" in result["stderr"] and "unusable" in result["stderr"]
    assert result["aot"] == "saved" and result["traced"] == 1 and result["misses"] == 0
    assert result["logits"] == first["logits"]


def test_aot_off_switch_traces(cold, tmp_path):
    _, first = cold
    cache, aot = _aot_copy(cold, tmp_path)
    before = aot.read_bytes()
    result = _run(cache, tmp_path / "inductor", DYNAMO_ONCE_AOT="0")
    assert result["aot"] == "off" and result["aot_loads"] == 0 and result["traced"] == 1
    assert result["dynamo_graphs"] == 1 and result["trace"] == "dynamo"
    assert result["status"] == "hit" and result["misses"] == 0 and result["logits"] == first["logits"]
    assert aot.read_bytes() == before  # neither read nor written


def test_garbage_entry_is_a_warning_and_a_recompile(cold, tmp_path):
    cache, first = cold
    mine = tmp_path / "cache" / "compile"
    mine.mkdir(parents=True)
    garbage = mine / pathlib.Path(first["path"]).name
    garbage.write_bytes(b"not a cache file")
    result = _run(tmp_path / "cache", tmp_path / "inductor")
    assert "unusable" in result["stderr"] and result["status"] == "corrupt" and result["writes"] == 1
    assert result["logits"] == first["logits"]


def test_two_processes_on_an_empty_cache_compile_once(cold, tmp_path):
    _, first = cold
    procs = [_start(tmp_path / "cache", tmp_path / f"inductor{i}") for i in range(2)]
    results = [_result(p) for p in procs]
    assert sorted(r["status"] for r in results) == ["hit", "miss"]
    assert sum(r["writes"] for r in results) == 1  # exactly one wrote the entry
    assert [r["misses"] == 0 for r in results].count(True) == 1  # and only it compiled
    assert all(r["logits"] == first["logits"] for r in results)
    assert len(list((tmp_path / "cache" / "compile").glob("*.bin"))) == 1


def test_off_switch_writes_nothing(tmp_path):
    result = _run(tmp_path / "cache", tmp_path / "inductor", DYNAMO_ONCE_DISABLE_COMPILE_CACHE="1")
    assert result["status"] == "off" and result["writes"] == 0
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- the key
MODEL_SOURCE = '''
import torch
from dispatcher import support_torch_compile


def scale():
    return 2.0


@support_torch_compile
class Small(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(8, width)
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) * scale() * self.factor
'''


def _key(module_name: str, width: int = 8, **config) -> str:
    """The compile-cache key of ``module_name``'s ``Small(width)`` under ``config`` (after its first call)."""
    module = importlib.import_module(module_name)
    with set_compilation_config(CompilationConfig(**{"level": 3, "use_cudagraph": False, **config})):
        model = module.Small(width)
    with torch.no_grad():
        model(torch.randn(4, 8))
    (compiled,) = [m for m in model.modules() if isinstance(m, TorchCompileWrapperWithCustomDispatcher)]
    return compiled.compile_cache.key


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "0")
    monkeypatch.setenv("DYNAMO_ONCE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"cc_model_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODEL_SOURCE)
    yield tmp_path / f"{name}.py", name
    sys.modules.pop(name, None)


def test_key_changes_with_config_passes_and_model_code(model_module):
    path, name = model_module
    base = _key(name)
    assert _key(name) == base  # stable
    assert _key(name, compile_sizes=[4]) != base
    assert _key(name, splitting_ops=["dynamo_once::other"]) != base
    assert _key(name, inductor_compile_config={"epilogue_fusion": False}) != base
    assert _key(name, pass_config="+noop") != base
    assert _key(name, check_inputs=False) == base  # not a factor: it does not change the compiled code
    assert _key(name, level=4) != base
    assert _key(name, width=16) != base  # the same code on other shapes (another size, a tensor-parallel shard)
    path.write_text(MODEL_SOURCE.replace("return 2.0", "return 3.0"))  # a helper's source: forward's bytecode is the same
    sys.modules.pop(name)
    importlib.invalidate_caches()
    assert _key(name) != base


def test_key_changes_with_inductors_pdl(model_module, monkeypatch):
    """``DYNAMO_ONCE_PDL=0`` turns Inductor's PDL off at level 3 and the library's kernels' PDL forms off: a warm
    start must not take kernels compiled with either."""
    from dispatcher import compat

    if compat.inductor_pdl_option() is None:
        pytest.skip("this torch's Inductor has no PDL option")
    _, name = model_module
    base = _key(name)
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    off = _key(name)
    assert off != base
    # the config's option turns Inductor's own PDL back on, not the library's kernels': a third build
    assert _key(name, inductor_compile_config={compat.inductor_pdl_option(): True}) not in (base, off)


def test_off_switch_in_process(model_module, monkeypatch, tmp_path):
    _, name = model_module
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "1")
    module = importlib.import_module(name)
    with set_compilation_config(CompilationConfig(level=3, use_cudagraph=False)):
        model = module.Small()
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert model.compile_cache is None
    assert not (tmp_path / "cache").exists()


def _small(module_name: str, factor: float = 1.0) -> tuple[torch.nn.Module, torch.Tensor]:
    """A ``Small`` (same weights each time) with ``factor`` set, and its first call's output."""
    module = importlib.import_module(module_name)
    torch.manual_seed(0)
    with set_compilation_config(CompilationConfig(level=3, use_cudagraph=False)):
        model = module.Small()
    model.factor = factor
    with torch.no_grad():
        return model, model(torch.arange(32.0).reshape(4, 8) / 32)


def test_aot_forward_in_process_and_what_it_is_specialized_on(model_module):
    _, name = model_module
    first, out = _small(name)
    assert first.aot_status == "saved"
    with compilation_counter.expect(num_graphs_seen=0, num_aot_loads=1, num_codes_captured=0):
        second, again = _small(name)
    assert second.aot_status == "loaded" and torch.equal(out, again)
    x = torch.randn(7, 8)  # another size of the dynamic dim: dispatched, no trace
    with torch.no_grad(), compilation_counter.expect(num_graphs_seen=0, num_dispatched_calls=2):
        assert torch.equal(second(x), first(x))
    with pytest.raises(Exception, match="dtype|float64"):  # the input checks of a traced forward hold too
        second(x.double())
    # A plain attribute the trace baked in differs: the artifact is not used, the model is traced.
    with compilation_counter.expect(num_graphs_seen=1, num_aot_loads=0):
        third, scaled = _small(name, factor=5.0)
    assert third.aot_status == "saved" and torch.allclose(scaled, 5 * out)


def test_aot_off_switch_in_process(model_module, monkeypatch):
    _, name = model_module
    _small(name)
    monkeypatch.setenv("DYNAMO_ONCE_AOT", "0")
    with compilation_counter.expect(num_graphs_seen=1, num_aot_loads=0):
        model, _ = _small(name)
    assert model.aot_status == "off"


# ---------------------------------------------------------------- the CLI
def test_cli_list_info_clear(cold, tmp_path, monkeypatch, capsys):
    cache, first = cold
    key = pathlib.Path(first["path"]).stem
    copy = tmp_path / "cache" / "compile"
    copy.mkdir(parents=True)
    (copy / f"{key}.bin").write_bytes(pathlib.Path(first["path"]).read_bytes())
    monkeypatch.setenv("DYNAMO_ONCE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "1 entry" in out and key[:16] in out and "LlamaModel.forward" in out
    assert main(["cache", "info", key[:8]]) == 0
    out = capsys.readouterr().out
    assert f"key: {key}" in out and "model_source" in out and "bytecode" in out and '"level": 3' in out
    assert main(["cache", "clear", key[:8]]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert not list(copy.glob("*.bin"))
    assert main(["cache", "clear"]) == 0 and "removed 0 entries" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["cache", "info", "ffff"], "no entry 'ffff'"),
    (["cache", "clear", "ffff"], "no entry 'ffff'"),
])
def test_cli_errors_are_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DYNAMO_ONCE_CACHE_DIR", str(tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_bad_cache_dir_is_one_line(tmp_path, monkeypatch, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("DYNAMO_ONCE_CACHE_DIR", str(not_a_dir))
    assert main(["cache", "list"]) == 2
    err = capsys.readouterr().err
    assert "DYNAMO_ONCE_CACHE_DIR" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
