"""diagnose: agreement on tiny-llama, the 1-vs-2 disagreement of a model with a branch on T; the CLI."""

import pytest
import torch

from models import LlamaForCausalLM, LlamaModel, load_model
from models.cli import COMMANDS, main
from models.diagnose import diagnose
from models.registry import BUILTIN_MODELS
from models.loader import build_model


class BranchyLlamaModel(LlamaModel):
    """Breaks the one-graph assumption: the output depends on the token count."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, inputs_embeds)
        if input_ids.shape[0] > 8:  # the warm-up (16 tokens) traces this side; decode steps take the other
            hidden = hidden * 2
        return hidden


class BranchyLlama(LlamaForCausalLM):
    model_class = BranchyLlamaModel


def branchy():
    model = build_model(BUILTIN_MODELS["tiny-llama"])
    weights = load_model("tiny-llama").state_dict()
    branchy = BranchyLlama(model.config)
    branchy.load_state_dict(weights)
    return branchy.eval()


def test_diagnose_reports_branch_on_token_count():
    report = diagnose(branchy, levels=(0, 1, 2))
    assert report.agree(0, 1)
    assert not report.agree(1, 2) and report.max_diff[(1, 2)] > 100 * report.tolerance
    assert report.results[1].recompiles >= 1  # level 1 re-traced when the branch flipped
    assert report.results[2].recompiles == 0
    assert "cannot be captured as one static graph" in report.format()


def test_cli_diagnose_tiny_llama(capsys):
    assert {"overhead", "env", "generate", "diagnose"} <= set(COMMANDS)
    assert main(["diagnose", "--model", "tiny-llama", "--levels", "0,1,2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "0 vs 1: 0  agree" in out and "1 vs 2: 0  agree" in out
    assert "all levels agree: levels 3/4 (Inductor) are safe to try." in out
    assert "DYNAMO_ONCE" in out and "compile (s)" in out


def test_cli_generate(capsys):
    assert main(["generate", "--model", "tiny-llama", "--level", "2", "--random-prompts", "--num-prompts", "3",
                 "--max-new-tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("prompt (") == 3 and "level 2 (DYNAMO_ONCE)" in out and "median decode step" in out


@pytest.mark.parametrize("levels", ["2", "1,1", "0,0,NO_COMPILATION"])
def test_cli_diagnose_fewer_than_two_levels_compares_nothing(levels, capsys):
    assert main(["diagnose", "--model", "tiny-llama", "--levels", levels, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fewer than two distinct levels, so it would compare nothing" in err
    assert "agree" not in err


@pytest.mark.parametrize("levels", ["0,banana", "0,7", "zero"])
def test_cli_diagnose_bad_levels_is_one_line(levels, capsys):
    assert main(["diagnose", "--model", "tiny-llama", "--levels", levels, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("dynamo-once diagnose: --levels: expected comma-separated compilation levels "
                                       f"0-4, e.g. 0,1,2,3; got {levels!r}\n")


def test_cli_diagnose_levels_off_the_usual_pairs_are_compared(capsys):
    assert main(["diagnose", "--model", "tiny-llama", "--levels", "0,3", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    assert "0 vs 3: " in capsys.readouterr().out


def test_torch_compile_disable_runs_an_explicit_level_as_0(monkeypatch, caplog, capsys):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    from models import LLM

    with caplog.at_level("WARNING"):
        llm = LLM("tiny-llama", level=2, max_num_tokens=16, device="cpu")
    assert int(llm.level) == 0
    assert "TORCH_COMPILE_DISABLE=1 disables torch.compile: running level 0 (no compilation) instead of level 2" \
        in caplog.text
    assert len(llm.generate([[1, 2, 3]], 2)[0]) == 2
    # diagnose: every level ran as 0, so it compared nothing: said so, exit 1 (not "all levels agree")
    assert main(["diagnose", "--model", "tiny-llama", "--levels", "0,2", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "compared nothing: fewer than two distinct levels ran (levels run: 0)" in out and "safe" not in out
