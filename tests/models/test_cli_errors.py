"""The ``dynamo-once`` command's contract: ``--help`` without importing torch; random prompts only with
``--random-prompts``; a user error (bad checkpoint, bad flag, bad DYNAMO_ONCE_* value) one line on stderr and
exit 2 for every command, the traceback only with ``--verbose``."""

import json
import subprocess
import sys

import pytest

from models.cli import COMMANDS, main


def test_help_imports_no_torch():
    # overhead's parser lives in its benchmark module (torch at import); every other command's --help is torch-free.
    code = ("import sys, contextlib, io\nfrom models.cli import COMMANDS, main\n"
            "for argv in [['--help']] + [[c, '--help'] for c in COMMANDS if c != 'overhead']:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def one_line(capsys, prefix):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith(prefix), err
    return err


def test_generate_needs_a_prompt_or_random_prompts(capsys):
    assert main(["generate", "--model", "tiny-llama"]) == 2
    one_line(capsys, "dynamo-once generate: give --prompt TEXT (or --random-prompts for prompts of random token ids)")
    assert main(["generate", "--prompt", "hi", "--random-prompts"]) == 2
    one_line(capsys, "dynamo-once generate: give --prompt or --random-prompts, not both")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_kv_cache_dtype_is_one_line(command, capsys):
    extra = ["--random-prompts"] if command == "generate" else ["--port", "0"]
    assert main([command, "--model", "tiny-llama", "--device", "cpu", *extra, "--kv-cache-dtype", "int4"]) == 2
    one_line(capsys, f"dynamo-once {command}: LLM: kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int4'")


@pytest.mark.parametrize("flag, value, words", [
    ("--top-p", "2", "top_p must be a number in (0, 1]; got 2.0"),
    ("--top-k", "-5", "top_k must be an int >= 1, or None or -1 for all tokens; got -5"),
    ("--temperature", "-1", "temperature must be a finite number >= 0 (0: greedy); got -1.0"),
    ("--max-tokens", "0", "max_tokens must be an int >= 1; got 0"),
    ("--presence-penalty", "5", "presence_penalty must be a number in [-2, 2]; got 5.0"),
    ("--repetition-penalty", "0", "repetition_penalty must be a finite number > 0 (1: off); got 0.0"),
    ("--min-tokens", "20", "min_tokens must be an int in [0, max_tokens=16]; got 20"),
])
@pytest.mark.parametrize("prompt", [["--prompt", "hi"], ["--random-prompts"]])
def test_bad_sampling_flag_is_one_line_whichever_prompts(prompt, flag, value, words, capsys):
    """Both prompt forms check every sampling flag (random prompts once ignored --top-p and took --top-k -5)."""
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", *prompt, flag, value]) == 2
    err = one_line(capsys, "dynamo-once generate: SamplingParams: ")
    assert words in err, err


@pytest.mark.parametrize("command", ["generate", "diagnose", "env", "serve"])
def test_bad_env_value_is_one_line(command, monkeypatch, capsys):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", "banana")
    extra = {"generate": ["--random-prompts", "--device", "cpu"], "diagnose": ["--device", "cpu"],
             "serve": ["--port", "0", "--device", "cpu"]}.get(command, [])
    model = [] if command == "env" else ["--model", "tiny-llama"]
    assert main([command, *model, *extra]) == 2
    one_line(capsys, f"dynamo-once {command}: ")
    with pytest.raises(ValueError, match="DYNAMO_ONCE_COMPILE_LEVEL='banana'"):
        main([command, *model, *extra, "--verbose"])


def test_compile_sizes_reach_the_cli_from_the_environment(monkeypatch, capsys):
    """``DYNAMO_ONCE_COMPILE_SIZES`` is the CLI's and the server's way to per-size compiles (``native_ops``)."""
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_SIZES", "256,128")
    assert main(["env"]) == 0
    assert "compile_sizes=[128, 256]" in capsys.readouterr().out
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_SIZES", "128,big")
    assert main(["generate", "--model", "tiny-llama", "--random-prompts", "--device", "cpu"]) == 2
    err = one_line(capsys, "dynamo-once generate: ")
    assert "DYNAMO_ONCE_COMPILE_SIZES='128,big'" in err and "positive integers" in err, err


@pytest.fixture
def bad_ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": "64"}))
    return str(tmp_path)


@pytest.mark.parametrize("command, extra", [("generate", ["--prompt", "hi"]), ("generate", ["--random-prompts"]),
                                            ("diagnose", []), ("serve", ["--port", "0"])])
def test_bad_checkpoint_is_one_line(command, extra, bad_ckpt, capsys):
    assert main([command, "--model", bad_ckpt, "--device", "cpu", *extra]) == 2
    err = one_line(capsys, f"dynamo-once {command}: ")
    assert bad_ckpt in err


@pytest.mark.parametrize("command", ["generate", "diagnose"])
def test_bad_flag_value_is_one_line(command, capsys):
    assert main([command, "--quantization", "banana", "--random-prompts"][:3 if command == "diagnose" else 4]) == 2
    one_line(capsys, f"dynamo-once {command}: --quantization: expected one of")
    with pytest.raises(SystemExit) as e:  # argparse's own: usage and one error line, exit 2
        main([command, "--no-such-flag"])
    assert e.value.code == 2


def test_verbose_is_taken_by_every_command(capsys):
    assert main(["env", "--verbose"]) == 0
    assert "DYNAMO_ONCE_COMPILE_LEVEL" in capsys.readouterr().out
    assert set(COMMANDS) >= {"generate", "diagnose", "serve", "env", "cache", "overhead"}
