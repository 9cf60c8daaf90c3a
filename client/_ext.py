"""Build (just in time, with ninja) and load the a2ad CUDA extension.

The extension registers the ops ``torch.ops.a2ad.*`` (see ``csrc/bindings.cpp``).
It is built once per combination of sources, torch version, CUDA version and
target architecture, into ``$A2AD_EXT_DIR/<hash>`` (default
``~/.cache/a2ad/ext/<hash>``); editing a source changes the hash, so the next
load rebuilds. A failed build raises :class:`a2ad.errors.BuildError` carrying
the tail of the compiler output.

Environment:

- ``A2AD_EXT_DIR``: root of the build cache.
- ``A2AD_CUDA_ARCH``: nvcc ``-arch`` value (default ``sm_90``).
- ``A2AD_CSRC``: folder holding the sources (default: ``csrc`` at the repository root).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

import a2ad
from a2ad import errors

SOURCES = ("moe_a2a.cu", "bindings.cpp")
HEADERS = ("moe_a2a.cuh",)
DEFAULT_ARCH = "sm_90"
#: Characters of compiler output kept in a BuildError.
ERROR_TAIL = 6000

_lock = threading.Lock()
_loaded: str | None = None


def csrc_dir() -> Path:
    env = os.environ.get("A2AD_CSRC")
    if env:
        return Path(env).expanduser().resolve()
    return Path(a2ad.__file__).resolve().parent.parent / "csrc"


def cuda_arch() -> str:
    return os.environ.get("A2AD_CUDA_ARCH", DEFAULT_ARCH)


def build_hash(src: Path, arch: str) -> str:
    """Hash of everything the built library depends on."""
    import torch

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        path = src / name
        h.update(name.encode())
        h.update(path.read_bytes())
    h.update(f"torch={torch.__version__};cuda={torch.version.cuda};arch={arch};py={sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def build_dir(digest: str) -> Path:
    root = os.environ.get("A2AD_EXT_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "a2ad" / "ext"
    return base / digest


def load():
    """Build if needed, load once per process, and return ``torch.ops.a2ad``."""
    global _loaded
    import torch

    with _lock:
        if _loaded is None:
            _loaded = _build_and_load()
    return torch.ops.a2ad


def _build_and_load() -> str:
    import torch
    from torch.utils import cpp_extension

    src = csrc_dir()
    missing = [n for n in SOURCES + HEADERS if not (src / n).is_file()]
    if missing:
        raise errors.BuildError(f"a2ad CUDA sources not found in {src}: missing {', '.join(missing)} (set A2AD_CSRC)")
    arch = cuda_arch()
    digest = build_hash(src, arch)
    out = build_dir(digest)
    out.mkdir(parents=True, exist_ok=True)
    name = f"a2ad_ext_{digest}"
    fresh = not any(out.glob(f"{name}*.so"))
    if fresh:
        print(f"building a2ad CUDA extension (first use, ~1 min) in {out} ...", file=sys.stderr, flush=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(src / n) for n in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", f"-arch={arch}"],
            extra_include_paths=[str(src)],
            build_directory=str(out),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        text = str(exc)
        tail = text[-ERROR_TAIL:]
        raise errors.BuildError(
            f"building the a2ad CUDA extension in {out} failed:\n{tail}", build_dir=str(out), arch=arch
        ) from None
    if fresh:
        print("a2ad CUDA extension built.", file=sys.stderr, flush=True)
    if not hasattr(torch.ops.a2ad, "dispatch"):
        raise errors.BuildError(f"the a2ad extension in {out} loaded but registered no ops")
    return str(out)
