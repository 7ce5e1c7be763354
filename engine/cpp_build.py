"""The one way Baton builds native code: a C++ source next to its loader, compiled on first use per machine.

torch's cpp_extension compiles it with -O3 -march=native -fopenmp into $BATON_CACHE/torch_extensions, in a
directory keyed by the source's content (an edited kernel builds afresh) and, since -march=native builds run
only on the CPU they were built for, the CPU's feature flags. Each extension is built once per process; with no
compiler the loader gets None (and a warning) and keeps serving with its torch fallback. A module built before is
imported directly, never through cpp_extension's lock (see _import).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"]
READY = "baton-built"          # written after a build completes: the .so beside it is whole

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def load_extension(name: str, source: Path, what: str, extra_cflags: tuple[str, ...] = (),
                   includes: tuple[Path, ...] = ()) -> ModuleType | None:
    """The compiled module `name` from `source` (and the sources it #includes, `includes`, which key its build
    too), or None when it cannot be built (logged once as a warning naming `what`, what the caller falls back
    from)."""
    with _lock:
        if name not in _loaded:
            try:
                from torch.utils.cpp_extension import load
                from engine.loader import cache_dir
                cflags = CFLAGS + list(extra_cflags)
                build = cache_dir() / "torch_extensions" / f"torch{torch.__version__}-{build_key(name, source, cflags, includes)}"
                build.mkdir(parents=True, exist_ok=True)
                built = build / f"{name}.so"
                if (build / READY).exists() and built.exists():
                    _loaded[name] = _import(name, built)
                else:
                    log.info("loading the %s (compiled on first use per machine, ~30 s)", what)
                    _loaded[name] = load(name, sources=[str(source)], extra_cflags=cflags,
                                         extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
                    (build / READY).touch()
            except Exception as e:                       # noqa: BLE001 - no compiler: keep serving
                _loaded[name] = None
                log.warning("%s unavailable (%s); using the torch reference", what, e)
        return _loaded[name]


def _import(name: str, path: Path) -> ModuleType:
    """A module built before, imported without cpp_extension.load: load() takes a lock file in the build directory
    even when nothing needs building, and a process killed holding it (a replica SIGKILLed mid-start) would leave
    every later engine start waiting on it forever."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_key(name: str, source: Path, cflags: list[str], includes: tuple[Path, ...] = ()) -> str:
    """The build directory's key: the module's name, the sources' content, the flags and the CPU's feature flags."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    code = b"".join(p.read_bytes() for p in (source, *includes))
    return hashlib.blake2b(name.encode() + code + " ".join(cflags).encode() + flags.encode(), digest_size=6).hexdigest()
