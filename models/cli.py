"""The ``dynamo-once`` command."""

from __future__ import annotations

import argparse
import logging
import sys


def _overhead(argv: list[str]) -> int:
    from benchmarks import guard_overhead

    guard_overhead.main(argv)
    return 0


def _env(argv: list[str]) -> int:
    import os

    from dispatcher import envs, get_compilation_config

    argparse.ArgumentParser(prog="dynamo-once env", description="show DYNAMO_ONCE_* variables").parse_args(argv)
    for name, doc in envs.ENV_VARS.items():
        print(f"{name}={os.environ.get(name, '')!s:12} {doc}")
    print(f"\neffective config: {get_compilation_config()}")
    return 0


COMMANDS = {
    "overhead": (_overhead, "per-call dispatch overhead: stock torch.compile vs dynamo-once (benchmark)"),
    "env": (_env, "list the DYNAMO_ONCE_* variables and the effective compilation config"),
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
    return COMMANDS[cmd][0](rest)


if __name__ == "__main__":
    sys.exit(main())
