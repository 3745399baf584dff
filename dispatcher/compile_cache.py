"""The compile cache of levels 3-4: Inductor's artifacts of one compiled model on disk, for a warm start.

What is saved: ``torch.compiler.save_cache_artifacts()`` (Inductor's FX graphs with their generated code,
the AOTAutograd entries, autotuning results) after a model's first call, which traces it and compiles every
piece; once more when a later compile of the process missed (a per-size compile during CUDA-graph capture).
A later process loads them with ``load_cache_artifacts()`` before its trace, so that every piece's and size's
Inductor compile is an FX-graph-cache hit: no Inductor codegen. Next to it, ``<key>.aot`` holds the AOT forward
(``dispatcher.aot``: Dynamo's bytecode and FX graph, written down), with which a warm start skips Dynamo's
trace too; the wrapper reads and writes it (:meth:`CacheEntry.read_aot`, :meth:`CacheEntry.write_aot`) under
the same lock.

The key is a sha256 over the factors that decide the compiled code (:func:`key_factors`), each logged at
debug level. Inductor checks its own keys at every lookup, so a factor the key misses costs a compile (and a
rewrite of the entry), never a wrong result.

On disk, under ``<DYNAMO_ONCE_CACHE_DIR or ~/.cache/dynamo_once>/compile/``: ``<key>.bin`` holds a magic line,
a JSON header (key, torch version, the payload's length and sha256, the factors) and the payload; it is
written to a temporary file in the same directory and renamed over. ``<key>.lock`` is held (``flock``) from
before the load until after the save, so of two processes starting the same model one compiles and writes,
and the other waits and loads. A truncated or corrupt file, or one of another torch version, is a warning
and a recompile that rewrites it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import compat, envs
from .config import CompilationConfig, CompilationLevel

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
    fcntl = None

logger = logging.getLogger(__name__)

__all__ = ["ArtifactError", "CacheEntry", "UnhashableFactor", "cache_root", "key_factors", "compute_key",
           "open_entry", "list_entries", "read_header", "find_keys", "remove_entry"]

MAGIC = b"dynamo-once compile cache 1\n"
SUFFIX = ".bin"
AOT_SUFFIX = ".aot"


class ArtifactError(Exception):
    """A cache file that cannot be used: truncated, corrupt, or written for another key or torch version."""


class UnhashableFactor(ValueError):
    """A factor of the key with no stable hash (e.g. an Inductor option holding a callable without uuid())."""


def cache_root() -> Path:
    """Where the entries are: ``compile/`` in the library's cache directory (``DYNAMO_ONCE_CACHE_DIR``)."""
    return Path(envs.cache_dir()) / "compile"


# ------------------------------------------------------------------ the key
def _code_digest(h: Any, code: types.CodeType) -> None:
    """Hash a code object's bytecode, names and constants (nested codes too), not its file name or lines."""
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
                   code.co_kwonlyargcount, code.co_flags)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(h, c)
        elif isinstance(c, frozenset):  # iteration order follows the per-process string hash seed
            h.update(repr(sorted(map(repr, c))).encode())
        else:
            h.update(repr(c).encode())


def bytecode_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()
    _code_digest(h, code)
    return h.hexdigest()


def _module_source(name: str) -> bytes:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not path or not os.path.isfile(path):
        raise UnhashableFactor(f"the source of module {name!r} is not in a file")
    return Path(path).read_bytes()


def source_digest(owner: Any, function: types.FunctionType) -> str:
    """sha256 of the source files of the model's code: the modules defining the class of each submodule
    of ``owner`` (an ``nn.Module``) and of their bases, or ``function``'s module. torch's own modules are left
    out (the torch version is a factor of its own)."""
    classes = {type(m) for m in owner.modules()} if isinstance(owner, torch.nn.Module) else set()
    names = {function.__module__}
    for cls in classes:
        names.update(base.__module__ for base in cls.__mro__)
    names = {n for n in names if n != "builtins" and n.split(".")[0] != "torch"}
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(f"\n{name}\n".encode())
        h.update(hashlib.sha256(_module_source(name)).digest())
    return h.hexdigest()


def _stable(value: Any, where: str) -> Any:
    """``value`` as JSON, with an Inductor custom pass as its ``uuid()``; anything else is an error."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_stable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _stable(v, f"{where}[{k!r}]") for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    uuid = getattr(value, "uuid", None)
    key = uuid() if callable(uuid) else None
    if key is None:
        raise UnhashableFactor(f"Inductor option {where} = {value!r} has no stable hash (a custom pass needs a "
                               f"uuid() that is not None)")
    return f"uuid:{key}"


def device_kind(tensors: list[Any]) -> str:
    """``"cpu"``, or the GPU's name and architecture (``"cuda NVIDIA H200 sm_90"``) of the first CUDA tensor."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            p = torch.cuda.get_device_properties(t.device)
            return f"cuda {p.name} sm_{p.major}{p.minor}"
    kinds = sorted({t.device.type for t in tensors if isinstance(t, torch.Tensor)})
    return ",".join(kinds) or "cpu"


def config_factors(config: CompilationConfig, level: CompilationLevel) -> dict[str, Any]:
    """The config fields that change what is compiled, or which compiles a process makes.

    Left out: ``backend`` (levels 3-4 always use Inductor); ``use_bytecode_hook``, ``check_inputs``, ``debug``,
    ``debug_dump_path`` (how calls are dispatched and checked, not what is compiled); ``pass_config`` and
    ``inductor_compile_config`` enter as the Inductor options (the pass manager's uuid, the merged options).
    """
    return {"level": int(level), "custom_ops": list(config.custom_ops), "fullgraph": config.fullgraph,
            "splitting_ops": list(config.splitting_ops), "compile_sizes": list(config.compile_sizes),
            "cudagraph_capture_sizes": list(config.cudagraph_capture_sizes),
            "use_cudagraph": config.use_cudagraph, "cudagraph_mode": config.cudagraph_mode}


def key_factors(config: CompilationConfig, level: CompilationLevel, options: dict[str, Any], owner: Any,
                function: types.FunctionType, code: types.CodeType, tensors: list[Any]) -> dict[str, Any]:
    """Everything the key hashes, by name.

    Args:
        options: the Inductor options of the compiles (plugin's, the config's, the level's, the pass manager).
        owner: what ``function`` is bound to (the model), whose code's source files are hashed.
        code: the bytecode Dynamo traces (``forward``'s).
        tensors: the first call's tensors and the model's parameters, for the device.

    Raises:
        UnhashableFactor: a factor with no stable hash; the model then runs without the cache.
    """
    return {
        "torch": torch.__version__,
        "triton": compat.triton_version(),
        "python": sys.version.split()[0],
        "device": device_kind(tensors),
        "config": config_factors(config, level),
        "inductor_options": _stable(options, "options"),
        "model_source": source_digest(owner, function),
        "bytecode": bytecode_digest(code),
        "parameters": parameter_digest(owner),
    }


def parameter_digest(owner: Any) -> str:
    """sha256 of the names, shapes and dtypes of the model's parameters and buffers: the same code on other
    shapes (another size of the architecture, a tensor-parallel shard) is another entry ("" for no module)."""
    if not isinstance(owner, torch.nn.Module):
        return ""
    h = hashlib.sha256()
    for name, t in (*owner.named_parameters(), *owner.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()


def compute_key(factors: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ the files
def _encode(header: dict[str, Any], payload: bytes) -> bytes:
    h = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(h).to_bytes(8, "little") + h + payload


def _split(data: bytes, path: Path) -> tuple[dict[str, Any], bytes]:
    if not data.startswith(MAGIC):
        raise ArtifactError(f"{path.name} is not a dynamo-once compile cache file (or its start is corrupt)")
    start = len(MAGIC) + 8
    n = int.from_bytes(data[len(MAGIC):start], "little")
    if len(data) < start + n:
        raise ArtifactError(f"{path.name} is truncated (in its header)")
    try:
        header = json.loads(data[start:start + n])
    except ValueError:
        raise ArtifactError(f"{path.name} has a corrupt header") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path.name} has a corrupt header")
    return header, data[start + n:]


def read_header(path: Path) -> dict[str, Any]:
    """An entry's header (no payload check). Raises ArtifactError for a file that is not one."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        n = int.from_bytes(head[len(MAGIC):], "little") if len(head) == len(MAGIC) + 8 else 0
        head += f.read(min(n, 1 << 24))
    return _split(head, path)[0]


def read_artifact(path: Path, key: str) -> bytes:
    """The payload of ``path``, checked: complete, intact, for ``key`` and this torch. Raises ArtifactError."""
    header, payload = _split(path.read_bytes(), path)
    if len(payload) != header.get("payload_bytes"):
        raise ArtifactError(f"{path.name} is truncated: {len(payload)} of {header.get('payload_bytes')} bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise ArtifactError(f"{path.name} is corrupt (its payload's sha256 differs from its header's)")
    if header.get("key") != key:
        raise ArtifactError(f"{path.name} was written for key {header.get('key')!r}")
    if header.get("torch") != torch.__version__:
        raise ArtifactError(f"{path.name} was written by torch {header.get('torch')}, this is {torch.__version__}")
    return payload


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path`` and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created) for the block; logs when it has to wait."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "ab") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s: waiting for another process that compiles the same model (%s)", name, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------ an entry
@dataclasses.dataclass
class CacheEntry:
    """One model's entry, as its process uses it.

    Attributes:
        status: ``"hit"`` (loaded), ``"miss"`` (no file) or ``"corrupt"`` (a file that could not be used).
        loaded: artifacts loaded; load_s: seconds to read and load them.
        writes: how many times this process wrote the entry.
    """

    name: str
    key: str
    factors: dict[str, Any]
    root: Path
    status: str = "miss"
    loaded: int = 0
    load_s: float = 0.0
    writes: int = 0
    _misses_seen: int = 0

    @property
    def path(self) -> Path:
        return self.root / f"{self.key}{SUFFIX}"

    @property
    def aot_path(self) -> Path:
        """The AOT forward (``dispatcher.aot``) next to the Inductor artifacts: ``<key>.aot``."""
        return self.root / f"{self.key}{AOT_SUFFIX}"

    def read_aot(self) -> bytes | None:
        """The AOT artifact's payload, checked as :func:`read_artifact` checks; None when there is none.
        Raises ArtifactError (or OSError) for a file that cannot be used."""
        if not self.aot_path.exists():
            return None
        return read_artifact(self.aot_path, self.key)

    def write_aot(self, payload: bytes) -> None:
        """Write the AOT artifact (atomically, as the Inductor artifacts); the caller holds the lock."""
        header = {"key": self.key, "name": self.name, "torch": torch.__version__, "payload_bytes": len(payload),
                  "payload_sha256": hashlib.sha256(payload).hexdigest(), "kind": "aot"}
        write_atomic(self.aot_path, _encode(header, payload))
        logger.info("%s: AOT forward written: %s (%d bytes)", self.name, self.aot_path, len(payload))

    def lock(self) -> contextlib.AbstractContextManager[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        return _file_lock(self.root / f"{self.key}.lock", self.name)

    def load(self) -> str:
        """Load the entry's artifacts into Inductor's caches, if there is a usable file; returns the status."""
        t0 = time.perf_counter()
        self._misses_seen = compat.fx_graph_cache_counts()[1]
        if not self.path.exists():
            self.status = "miss"
            return self.status
        try:
            self.loaded = compat.load_cache_artifacts(read_artifact(self.path, self.key))
            self.status = "hit"
        except Exception as e:  # ArtifactError, or torch refusing the payload
            logger.warning("%s: compile cache entry %s unusable (%s); compiling and rewriting it",
                           self.name, self.path, e)
            self.status = "corrupt"
        self.load_s = time.perf_counter() - t0
        logger.info("%s: compile cache %s for key %s (%d artifacts, %.2fs)", self.name, self.status,
                    self.key[:16], self.loaded, self.load_s)
        return self.status

    def save(self) -> bool:
        """Write the process's artifacts unless the entry already holds them: after a hit, or after a write,
        only when a compile since then missed Inductor's FX graph cache. Returns whether it wrote."""
        misses = compat.fx_graph_cache_counts()[1]
        if (self.status == "hit" or self.writes) and misses == self._misses_seen:
            return False
        payload = compat.save_cache_artifacts()
        if not payload:
            logger.debug("%s: no compile artifacts recorded (Inductor's FX graph cache off?)", self.name)
            return False
        header = {"key": self.key, "name": self.name, "torch": torch.__version__, "payload_bytes": len(payload),
                  "payload_sha256": hashlib.sha256(payload).hexdigest(), "factors": self.factors,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        write_atomic(self.path, _encode(header, payload))
        self.writes += 1
        self._misses_seen = misses
        logger.info("%s: compile cache written: %s (%d bytes)", self.name, self.path, len(payload))
        return True

    def save_locked(self) -> bool:
        """:meth:`save` under the entry's lock (a later save, e.g. after the CUDA-graph capture's compiles); an
        OSError (a full disk, a read-only directory) is a warning."""
        try:
            with self.lock():
                return self.save()
        except OSError as e:
            logger.warning("%s: compile cache not written: %s", self.name, e)
            return False


def open_entry(name: str, config: CompilationConfig, level: CompilationLevel, options: dict[str, Any],
               owner: Any, function: types.FunctionType, code: types.CodeType,
               tensors: list[Any]) -> CacheEntry | None:
    """The entry of a model about to be traced (arguments: :func:`key_factors`'s); None with the cache off
    (``DYNAMO_ONCE_DISABLE_COMPILE_CACHE=1``) or a factor with no stable hash (a warning says which)."""
    if envs.compile_cache_disabled():
        logger.debug("%s: compile cache off (DYNAMO_ONCE_DISABLE_COMPILE_CACHE)", name)
        return None
    try:
        factors = key_factors(config, level, options, owner, function, code, tensors)
    except (UnhashableFactor, OSError) as e:
        logger.warning("%s: compile cache off for this model: %s", name, e)
        return None
    key = compute_key(factors)
    for factor, value in factors.items():
        logger.debug("%s: compile cache key %s: %s = %s", name, key[:16], factor, value)
    return CacheEntry(name, key, factors, cache_root())


@contextlib.contextmanager
def first_compile(entry: CacheEntry | None) -> Iterator[None]:
    """Around a model's first call: lock, load, and (when the call returns) save the entry."""
    if entry is None:
        yield
        return
    try:
        lock = entry.lock()
        lock.__enter__()
    except OSError as e:  # e.g. a read-only cache directory
        logger.warning("%s: compile cache off for this model: cannot lock %s (%s)", entry.name, entry.root, e)
        yield
        return
    try:
        entry.load()
        yield
        try:
            entry.save()
        except OSError as e:  # e.g. a full disk: the model is compiled, only the next start is cold
            logger.warning("%s: compile cache not written: %s", entry.name, e)
    finally:
        lock.__exit__(None, None, None)


# ------------------------------------------------------------------ the entries (for the CLI)
def list_entries(root: Path | None = None) -> list[tuple[str, Path, dict[str, Any] | None]]:
    """``(key, path, header)`` of every entry, sorted by key; header None for a file that is not one."""
    root = cache_root() if root is None else root
    out = []
    for path in sorted(root.glob(f"*{SUFFIX}")) if root.is_dir() else []:
        try:
            header = read_header(path)
        except (ArtifactError, OSError):
            header = None
        out.append((path.name[:-len(SUFFIX)], path, header))
    return out


def find_keys(prefix: str, root: Path | None = None) -> list[str]:
    """The keys starting with ``prefix``."""
    return [key for key, _, _ in list_entries(root) if key.startswith(prefix)]


def remove_entry(key: str, root: Path | None = None) -> None:
    """Remove an entry's file, and its lock file unless a process holds it."""
    root = cache_root() if root is None else root
    (root / f"{key}{SUFFIX}").unlink(missing_ok=True)
    (root / f"{key}{AOT_SUFFIX}").unlink(missing_ok=True)
    lock = root / f"{key}.lock"
    if fcntl is None or not lock.exists():
        return
    with open(lock, "ab") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # in use: the process holding it may write the entry again
        lock.unlink(missing_ok=True)
