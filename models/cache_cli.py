"""``dynamo-once cache list | info KEY | clear [KEY]``: the compile cache's entries (``dispatcher.compile_cache``).

KEY may be any unique prefix of a key (as ``list`` shows them). Bad input is a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys


class _Error(Exception):
    pass


def _one_key(prefix: str) -> str:
    from dispatcher import compile_cache  # after parsing: --help without torch

    keys = compile_cache.find_keys(prefix)
    if not keys:
        raise _Error(f"no entry {prefix!r} in {compile_cache.cache_root()}")
    if len(keys) > 1:
        raise _Error(f"{prefix!r} is ambiguous: {len(keys)} entries start with it")
    return keys[0]


def _list(args: argparse.Namespace) -> None:
    from dispatcher import compile_cache  # after parsing: --help without torch

    entries = compile_cache.list_entries()
    print(f"{compile_cache.cache_root()}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    for key, path, header in entries:
        if header is None:
            print(f"{key[:16]}  {path.stat().st_size:>10}  (not a readable entry)")
            continue
        factors = header.get("factors", {})
        print(f"{key[:16]}  {path.stat().st_size:>10}  {header.get('created', '?'):25}  torch {header.get('torch')}"
              f"  {factors.get('device', '?')}  {header.get('name', '?')}")


def _info(args: argparse.Namespace) -> None:
    from dispatcher import compile_cache  # after parsing: --help without torch

    key = _one_key(args.key)
    path = compile_cache.cache_root() / f"{key}{compile_cache.SUFFIX}"
    try:
        header = compile_cache.read_header(path)
    except compile_cache.ArtifactError as e:
        raise _Error(str(e)) from None
    factors = header.pop("factors", {})
    for name, value in {"path": str(path), "bytes": path.stat().st_size, **header}.items():
        print(f"{name}: {value}")
    print("factors of the key:")
    for name, value in factors.items():
        print(f"  {name}: {json.dumps(value, sort_keys=True)}")


def _clear(args: argparse.Namespace) -> None:
    from dispatcher import compile_cache  # after parsing: --help without torch

    keys = [_one_key(args.key)] if args.key else [k for k, _, _ in compile_cache.list_entries()]
    for key in keys:
        compile_cache.remove_entry(key)
    print(f"removed {len(keys)} entr{'y' if len(keys) == 1 else 'ies'} from {compile_cache.cache_root()}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dynamo-once cache",
                                description="the compile cache of levels 3-4 (DYNAMO_ONCE_CACHE_DIR/compile)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every entry: key, bytes, created, torch, device, model")
    sub.add_parser("info", help="one entry's header: its key's factors").add_argument("key", help="a key or its prefix")
    sub.add_parser("clear", help="remove one entry, or all").add_argument("key", nargs="?", help="a key or its prefix")
    args = p.parse_args(argv)
    try:
        {"list": _list, "info": _info, "clear": _clear}[args.command](args)
    except (_Error, ValueError, OSError) as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    return 0
