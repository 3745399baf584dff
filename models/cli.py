"""The ``dynamo-once`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def _overhead(argv: list[str]) -> int:
    from models import overhead

    overhead.main(argv, default_out=".")
    return 0


def _env(argv: list[str]) -> int:
    import os

    argparse.ArgumentParser(prog="dynamo-once env", description="show DYNAMO_ONCE_* variables").parse_args(argv)
    from dispatcher import envs, get_compilation_config

    for name, doc in envs.ENV_VARS.items():
        print(f"{name}={os.environ.get(name, '')!s:12} {doc}")
    print(f"\neffective config: {get_compilation_config()}")
    return 0


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama",
                        help="checkpoint directory or built-in name (default tiny-llama; built-in: %(choices)s)"
                        .replace("%(choices)s", ", ".join(_builtin_names())))
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    parser.add_argument("--quantization", default=None, metavar="fp8|int8",
                        help="W8A8: the built-in's quantized variant (--model llama-3-8b --quantization fp8 is "
                             "llama-3-8b-fp8); a checkpoint directory must already be quantized so")


def _quantized_model(model: str, quantization: str | None) -> str:
    """The model ``--quantization`` asks for: the built-in's quantized variant, or the checkpoint directory
    itself once its ``quantization_config`` is of that kind.

    Raises:
        ValueError: a bad value, no such quantized built-in, or a checkpoint quantized otherwise (one line).
    """
    import os

    from models.registry import BUILTIN_MODELS, QUANTIZATIONS

    if quantization is None:
        return model
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization: expected one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if os.path.isdir(model):
        from models.loader import read_config
        from models.quantization import parse_quantization_config

        config = parse_quantization_config(read_config(model))
        kinds = sorted({s.kind for s in config.schemes()}) if config else ["not quantized"]
        if kinds != [quantization]:
            raise ValueError(f"--quantization {quantization}: checkpoint {model} is {', '.join(kinds)}")
        return model
    name = model if model.endswith(f"-{quantization}") else f"{model}-{quantization}"
    if name not in BUILTIN_MODELS:
        quantized = [n for n in BUILTIN_MODELS if n.endswith(tuple(f"-{q}" for q in QUANTIZATIONS))]
        raise ValueError(f"--quantization {quantization}: no built-in {name!r} (quantized built-ins: "
                         f"{', '.join(quantized)})")
    return name


class UserError(ValueError):
    """A mistake on the command line: :func:`main` prints it as one line and exits 2."""


#: What a command raises for input the user can fix (CheckpointError, a bad flag or DYNAMO_ONCE_* value,
#: SamplingParams, no tokenizer, a missing optional package, a path that cannot be read or written):
#: one line and exit 2, the traceback only with --verbose.
USER_ERRORS = (ValueError, ImportError, OSError)


def _verbose_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="a traceback with errors")


def _builtin_names() -> list[str]:
    from models.registry import BUILTIN_MODELS

    return list(BUILTIN_MODELS)


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dynamo-once generate",
        description="continue --prompt (text, with the checkpoint's tokenizer), or, with --random-prompts, generate "
                    "tokens after random token prompts (benchmarking: prints ids and step timing)")
    _model_args(p)
    p.add_argument("--level", default=None, help="compilation level 0-4 (default: DYNAMO_ONCE_COMPILE_LEVEL, else 3)")
    p.add_argument("--prompt", default=None, help="text to continue; the generated text streams to stdout")
    p.add_argument("--chat", action="store_true", help="--prompt is a user message, through the chat template")
    p.add_argument("--random-prompts", action="store_true",
                   help="benchmarking: prompts of random token ids (no tokenizer needed); prints ids and step timing")
    p.add_argument("--num-prompts", type=int, default=4, help="random prompts (with --random-prompts)")
    p.add_argument("--prompt-len", type=int, default=16, help="longest random prompt; the others are shorter")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=16,
                   help="tokens to generate per prompt (default 16)")
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens per step")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks holding a shard of the model each, one process (and GPU) a rank (default 1)")
    p.add_argument("--kv-cache-dtype", default="auto",  # checked by LLM (no torch import for --help)
                   help="the paged KV cache's dtype: auto (default: the model's, or fp8 where the checkpoint has a "
                        "kv_cache_scheme), fp8 / fp8_e4m3 (half a bf16 cache's bytes a token)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes computed before (default on; "
                        "LLM(enable_prefix_caching=...))")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None, help="default: all tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's; default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's; default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; > 1 discourages repeats (default 1)")
    p.add_argument("--min-tokens", type=int, default=0, help="tokens before any stop may end a prompt (default 0)")
    _verbose_arg(p)
    args = p.parse_args(argv)
    args.model = _quantized_model(args.model, args.quantization)
    if args.prompt is None and not args.random_prompts:
        raise UserError("give --prompt TEXT (or --random-prompts for prompts of random token ids)")
    if args.prompt is not None and args.random_prompts:
        raise UserError("give --prompt or --random-prompts, not both")
    return _generate_text(args) if args.prompt is not None else _generate_random(args)


def _llm(args: argparse.Namespace) -> Any:
    from models import LLM

    return LLM(args.model, level=args.level, max_num_tokens=args.max_num_tokens, dtype=args.dtype,
               device=_device(args.device), tensor_parallel_size=args.tensor_parallel_size,
               kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching)


def _sampling_params(args: argparse.Namespace) -> Any:
    """Every sampling flag of ``generate`` (checked before the model loads)."""
    from models import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          min_tokens=args.min_tokens)


def _generate_text(args: argparse.Namespace) -> int:
    import time

    params = _sampling_params(args)
    llm = _llm(args)
    t0 = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        print(out.text, flush=True)
        num_tokens = len(out.token_ids)
    else:
        for piece in llm.generate_stream(args.prompt, params):
            print(piece, end="", flush=True)
        print()
        num_tokens = llm.stats.num_generated
    dt = time.perf_counter() - t0
    print(f"{num_tokens} tokens in {dt:.2f}s ({num_tokens / dt:.1f} tokens/s); model {args.model}, level "
          f"{int(llm.level)}, {llm.device}", file=sys.stderr)
    llm.close()  # tensor-parallel workers, if any
    return 0


def _generate_random(args: argparse.Namespace) -> int:
    import random

    params = _sampling_params(args)
    llm = _llm(args)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(llm.vocab_size) for _ in range(max(1, args.prompt_len - 3 * i))]
               for i in range(args.num_prompts)]
    out = llm.generate(prompts, params)
    for i, (prompt, new) in enumerate(zip(prompts, out)):
        print(f"[{i}] prompt ({len(prompt)} tokens) -> {list(new.token_ids)}")
    st = llm.stats
    print(f"\nmodel {args.model} ({type(llm.model).__name__}, {llm.dtype}, {llm.device}), level {int(llm.level)} "
          f"({llm.level.name})")
    print(f"load {llm.load_time_s:.2f}s, warm-up (trace + compile) {llm.compile_time_s:.2f}s")
    print(f"start-up: {llm.startup.format()}")
    print(f"{st.num_steps} steps ({st.num_mixed_steps} mixed prefill+decode), {st.num_generated} tokens in "
          f"{st.total_s:.3f}s; median decode step {st.median_decode_step_s * 1e3:.2f} ms"
          + (f"; {st.num_cached_tokens} prompt tokens from the prefix cache" if args.enable_prefix_caching else ""))
    llm.close()
    return 0


def _diagnose(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dynamo-once diagnose",
        description="run levels 0, 1, 2 (and 3) on the same input and say what their differences mean")
    _model_args(p)
    p.add_argument("--levels", default="0,1,2,3", help="comma-separated (default 0,1,2,3)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--tolerance", type=float, default=None, help="on max |logits diff| (default 1e-3 fp32, 5e-2 else)")
    _verbose_arg(p)
    args = p.parse_args(argv)
    args.model = _quantized_model(args.model, args.quantization)
    from models.diagnose import diagnose

    from dispatcher import CompilationLevel

    try:
        levels = [int(CompilationLevel.parse(x.strip())) for x in args.levels.split(",") if x.strip()]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--levels: expected comma-separated compilation levels 0-4, e.g. 0,1,2,3; "
                        f"got {args.levels!r}") from None
    report = diagnose(args.model, levels=levels, max_new_tokens=args.max_new_tokens, tolerance=args.tolerance,
                      dtype=args.dtype, device=_device(args.device))
    print(f"diagnose {args.model}: levels {', '.join(map(str, levels))} on one batch of prompts of different "
          f"lengths (prefill and decode mixed), fed the same tokens\n")
    print(report.format())
    return 0 if report.max_diff else 1  # compared nothing (TORCH_COMPILE_DISABLE=1 made every level 0)


COMMANDS = {
    "generate": (_generate, "continue --prompt with a checkpoint's tokenizer, or --random-prompts (ids, timing)"),
    "serve": (lambda argv: __import__("models.serve.cli", fromlist=["main"]).main(argv),
              "an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streaming), /v1/models"),
    "diagnose": (_diagnose, "run levels 0, 1, 2, 3 on the same input; report differences, compile time, step latency"),
    "overhead": (_overhead, "per-call dispatch overhead: stock torch.compile vs dynamo-once (benchmark)"),
    "env": (_env, "list the DYNAMO_ONCE_* variables and the effective compilation config"),
    "cache": (lambda argv: __import__("models.cache_cli", fromlist=["main"]).main(argv), "the compile cache: list | info KEY | clear [KEY]"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "dynamo-once COMMAND [options]\n\ncommands:\n" + "\n".join(
        f"  {name:10s} {doc}" for name, (_, doc) in COMMANDS.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"dynamo-once: unknown command {cmd!r}; expected one of {', '.join(COMMANDS)}\n\n{usage}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Every command: a user error is one line and exit 2, the traceback only with --verbose (which the
    # commands' parsers take; the others have it removed here).
    verbose = "--verbose" in rest
    if cmd not in ("generate", "diagnose", "serve"):
        rest = [a for a in rest if a != "--verbose"]
    try:
        return COMMANDS[cmd][0](rest)
    except USER_ERRORS as e:
        if verbose:
            raise
        print(f"dynamo-once {cmd}: {e}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
