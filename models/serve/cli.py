"""``dynamo-once serve``: an OpenAI-compatible HTTP server over one model (see :mod:`models.serve.app`).

The port is bound before the model loads, so a taken or bad port is a one-line error at once; user
errors (bad flag value, bad checkpoint, no tokenizer) are one line and exit 2, the traceback only with
``--verbose``.
"""

from __future__ import annotations

import argparse
import socket
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynamo-once serve",
                                description="serve --model over OpenAI's HTTP API: /v1/models, /v1/completions, "
                                            "/v1/chat/completions (streaming too)")
    p.add_argument("--model", required=True, help="checkpoint directory (with its tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the model's id in the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    p.add_argument("--port", default="8000", help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route (default: $DYNAMO_ONCE_API_KEY, else none)")
    p.add_argument("--level", default=None, help="compilation level 0-4 (default: DYNAMO_ONCE_COMPILE_LEVEL, else 3)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default min(64, max-num-tokens))")
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens per step (default 512)")
    p.add_argument("--num-cache-tokens", type=int, default=None, help="KV cache tokens (default max(8192, max-num-tokens))")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="size the KV cache from the GPU's memory instead: the share in (0, 1] of it this process may "
                        "take (vLLM's flag; e.g. 0.9)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks holding a shard of the model each, one process (and GPU) a rank (default 1)")
    p.add_argument("--kv-cache-dtype", default="auto",  # checked by LLM (no torch import before the port's bound)
                   help="the KV cache's dtype: auto (default: the model's, or the checkpoint's fp8 kv_cache_scheme), "
                        "fp8 / fp8_e4m3")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes seen before (a system prompt, earlier turns; default on)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--verbose", action="store_true", help="a traceback with errors")
    return p


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise ValueError(f"--port must be an integer in [0, 65535]; got {value!r}")
    return int(value)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _load(args: argparse.Namespace) -> object:
    import torch

    from models import LLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    llm = LLM(args.model, level=args.level, max_num_tokens=args.max_num_tokens, max_num_seqs=args.max_num_seqs,
              num_cache_tokens=args.num_cache_tokens, dtype=args.dtype, device=device,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=args.enable_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization)
    if llm.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer (tokenizer.json / tokenizer_config.json): the API is text")
    return llm


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        import uvicorn

        from dispatcher import envs

        from .app import build_app

        sock = _bind(args.host, _port(args.port))
        llm = _load(args)
    except (ValueError, ImportError, OSError) as e:  # CheckpointError, a bad flag, a taken port, no fastapi
        if args.verbose:
            raise
        hint = " (pip install 'dynamo-once[serve]')" if isinstance(e, ImportError) else ""
        print(f"{p.prog}: {e}{hint}".splitlines()[0], file=sys.stderr)
        return 2
    api_key = args.api_key or envs.api_key()
    app = build_app(llm, args.served_model_name or args.model, api_key=api_key)
    host, port = sock.getsockname()[:2]
    print(f"{p.prog}: {args.model} on http://{host}:{port}/v1 (level {int(llm.level)}, {llm.device})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
    server.run(sockets=[sock])
    return 0
