"""Build (just in time, with ninja) and load the a2ad CUDA extension.

The extension registers the ops ``torch.ops.a2ad.*`` (see ``csrc/bindings.cpp``).
It is built once per combination of sources, torch version, CUDA version and
target architectures, into ``$A2AD_EXT_DIR/<hash>`` (default
``~/.cache/a2ad/ext/<hash>``); editing a source changes the hash, so the next
load rebuilds. ``a2ad build-ext`` builds it ahead of time. A failed build raises
:class:`a2ad.errors.BuildError` carrying the tail of the compiler output.

Environment:

- ``A2AD_EXT_DIR``: root of the build cache.
- ``A2AD_CUDA_ARCH``: comma-separated target architectures, e.g. ``sm_90,sm_100``
  (default: those of the visible GPUs, else ``sm_90``).
- ``A2AD_CSRC``: folder holding the sources (default: ``a2ad/_csrc`` in an installed
  package, ``csrc`` at the root of a checkout).
- ``A2AD_KERNEL_TIMING=1``: build (and load) the timing build instead, compiled with
  ``-DA2AD_KERNEL_TIMING``: the only build whose plans accept kernel diagnostics
  (``CudaPlane.diag``). For the kernel timing harness, never for serving.
- ``A2AD_DEBUG=1``: build (and load) the debug build, compiled with ``-DA2AD_DEBUG_CHECKS``:
  the binding and the launchers check again what the Python front end already checked
  (csrc/bindings.cpp, "Checks"); a failed launcher check prints its condition.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import a2ad
from a2ad import errors

#: Every file of the extension: compiled sources, then headers (all part of the build hash).
SOURCES = ("dispatch.cu", "combine.cu", "sanitize.cu", "launch.cu", "quantize.cu", "ll.cu", "bindings.cpp")
HEADERS = ("moe_a2a.cuh", "primitives.cuh", "launch.cuh", "layout.h")
DEFAULT_ARCH = "sm_90"
#: Characters of compiler output kept in a BuildError.
ERROR_TAIL = 6000

_lock = threading.Lock()
_loaded: str | None = None
#: The loaded extension as a Python module: the data-plane functions without torch's
#: dispatcher (csrc/bindings.cpp), for the client's eager calls.
_module = None


def candidate_dirs() -> list[Path]:
    """Where the sources are looked for, in order."""
    env = os.environ.get("A2AD_CSRC")
    if env:
        return [Path(env).expanduser().resolve()]
    pkg = Path(a2ad.__file__).resolve().parent
    return [pkg / "_csrc", pkg.parent / "csrc"]  # installed package; checkout


def _complete(path: Path) -> bool:
    return all((path / n).is_file() for n in SOURCES + HEADERS)


def csrc_dir() -> Path:
    """The folder holding the CUDA sources (the first complete candidate; else the first)."""
    dirs = candidate_dirs()
    return next((d for d in dirs if _complete(d)), dirs[0])


def parse_arch(text: str) -> list[str]:
    """``"sm_90,sm_100"`` (also ``90``, ``9.0``, ``sm_90a``) -> ``["sm_90", "sm_100"]``, sorted, unique."""
    out: set[str] = set()
    for part in text.replace(";", ",").replace(" ", ",").split(","):
        part = part.strip().lower()
        if not part:
            continue
        m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)(?:\.(\d))?([af]?)", part)
        if not m:
            raise ValueError(f"not a CUDA architecture: {part!r} (e.g. sm_90, sm_100, 9.0)")
        major, minor, suffix = m.groups()
        num = f"{major}{minor}" if minor is not None else major
        if len(num) < 2:
            raise ValueError(f"not a CUDA architecture: {part!r} (e.g. sm_90, sm_100, 9.0)")
        out.add(f"sm_{num}{suffix}")
    if not out:
        raise ValueError(f"no CUDA architecture named in {text!r}")
    return sorted(out, key=lambda a: (int(re.match(r"sm_(\d+)", a).group(1)), a))


def visible_archs() -> list[str]:
    """Architectures of the GPUs this process sees (empty without any)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    except Exception:
        return []
    return parse_arch(",".join(f"sm_{a}{b}" for a, b in caps)) if caps else []


def cuda_archs(requested: str | Sequence[str] | None = None) -> list[str]:
    """The target list: *requested*, else ``$A2AD_CUDA_ARCH``, else the visible GPUs', else sm_90."""
    if requested:
        text = requested if isinstance(requested, str) else ",".join(requested)
        return parse_arch(text)
    env = os.environ.get("A2AD_CUDA_ARCH", "").strip()
    if env:
        return parse_arch(env)
    return visible_archs() or [DEFAULT_ARCH]


def gencode_flags(archs: Sequence[str]) -> list[str]:
    """nvcc flags: machine code for every architecture, plus PTX of the newest (for later GPUs)."""
    flags = []
    for arch in archs:
        num = arch.removeprefix("sm_")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    if archs:
        num = archs[-1].removeprefix("sm_")
        flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def find_nvcc() -> str | None:
    """nvcc as torch.utils.cpp_extension finds it: $CUDA_HOME (or $CUDA_PATH), PATH, /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        nvcc = Path(home) / "bin" / "nvcc"
        return str(nvcc) if nvcc.is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def guessed_cuda_home_problem() -> str | None:
    """Where CUDA_HOME is unset, torch takes the folder above the nvcc found on PATH as the CUDA
    toolkit's root; when that nvcc is a wrapper (a script or link in /usr/local/bin, say) the
    guess has no CUDA headers and the build fails on a missing cuda_runtime.h. Say so, and
    where the real toolkit seems to be."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return None
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    guess = Path(nvcc).parent.parent
    if (guess / "include" / "cuda_runtime.h").is_file():
        return None
    hint = ""
    real = Path(nvcc).resolve()
    candidates = [real.parent.parent] if real != Path(nvcc) else []
    try:
        if Path(nvcc).stat().st_size < 4096:  # a wrapper script: the nvcc it runs
            candidates += [Path(w).parent.parent for w in re.findall(r"(/[^\s'\"]*/bin/nvcc)\b", Path(nvcc).read_text())]
    except (OSError, UnicodeDecodeError):
        pass
    for c in candidates:
        if (c / "include" / "cuda_runtime.h").is_file():
            hint = f" (the toolkit it runs seems to be {c}: CUDA_HOME={c})"
            break
    return (f"CUDA_HOME is not set, so it is guessed from the nvcc on PATH ({nvcc}) as {guess}, which has no "
            f"include/cuda_runtime.h: that nvcc is a wrapper or lies outside its toolkit. Set CUDA_HOME to the "
            f"CUDA toolkit's root, the folder holding bin/nvcc and include/cuda_runtime.h{hint}")


def toolchain_problems() -> list[str]:
    """Why the extension cannot be built here (empty when it can, as far as can be told)."""
    import torch

    problems = []
    if torch.version.cuda is None:
        problems.append(
            f"this torch ({torch.__version__}) is built without CUDA: install a CUDA build of torch "
            "(https://pytorch.org/get-started/locally/ gives the pip command)"
        )
    if find_nvcc() is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        where = f"not in $CUDA_HOME/bin ({home})" if home else "not on PATH, no $CUDA_HOME, no /usr/local/cuda"
        want = f" {torch.version.cuda}" if torch.version.cuda else ""
        problems.append(
            f"nvcc (the CUDA compiler) is missing: {where}. Install the CUDA toolkit{want} matching torch "
            "(e.g. NVIDIA's cuda-toolkit / cuda-nvcc package, or pip install nvidia-cuda-nvcc-cu12) and put its "
            "bin/ on PATH or set CUDA_HOME to its root"
        )
    else:
        guessed = guessed_cuda_home_problem()
        if guessed:
            problems.append(guessed)
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        problems.append(
            f"Python's C headers are missing (no Python.h in {include}); the extension is also a Python module: "
            f"install them for this Python {sys.version_info.major}.{sys.version_info.minor} "
            f"(e.g. the python{sys.version_info.major}.{sys.version_info.minor}-dev package)"
        )
    return problems


def timing_build() -> bool:
    """Whether ``A2AD_KERNEL_TIMING`` asks for the timing build (diagnostics compiled in)."""
    return os.environ.get("A2AD_KERNEL_TIMING", "").strip().lower() not in ("", "0", "no", "false")


def debug_build() -> bool:
    """Whether ``A2AD_DEBUG`` asks for the debug build (the binding's and launchers' debug checks compiled in)."""
    return os.environ.get("A2AD_DEBUG", "").strip().lower() not in ("", "0", "no", "false")


def build_defines(timing: bool = False, debug: bool = False) -> list[str]:
    """The preprocessor defines of a build."""
    return (["-DA2AD_KERNEL_TIMING"] if timing else []) + (["-DA2AD_DEBUG_CHECKS"] if debug else [])


def build_hash(src: Path, arch: str, timing: bool = False, debug: bool = False) -> str:
    """Hash of everything the built library depends on (*arch*: the comma-separated target list)."""
    import torch

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        path = src / name
        h.update(name.encode())
        h.update(path.read_bytes())
    h.update(f"torch={torch.__version__};cuda={torch.version.cuda};arch={arch};py={sys.version_info[:2]}".encode())
    if timing:
        h.update(b";timing")
    if debug:
        h.update(b";debug")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("A2AD_EXT_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "a2ad" / "ext"


def build_dir(digest: str, root: Path | None = None) -> Path:
    return (Path(root).expanduser() if root else cache_root()) / digest


def load():
    """Build if needed, load once per process, and return ``torch.ops.a2ad``."""
    global _loaded, _module
    import torch

    with _lock:
        if _loaded is None:
            _loaded, _module = _build_and_load()
    return torch.ops.a2ad


def direct():
    """The loaded extension's module (built and loaded as :func:`load` does): ``dispatch``,
    ``combine`` and ``sanitize`` with the arguments of the ops of the same names, called
    without torch's dispatcher."""
    load()
    return _module


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _build_and_load(
    archs: Sequence[str] | None = None, root: Path | None = None, log: Callable[[str], None] = _stderr
) -> tuple[str, object]:
    """Build if needed and load; return the build folder and the extension's module."""
    import torch
    from torch.utils import cpp_extension

    src = csrc_dir()
    missing = [n for n in SOURCES + HEADERS if not (src / n).is_file()]
    if missing:
        looked = ", ".join(str(d) for d in candidate_dirs())
        raise errors.BuildError(
            f"a2ad CUDA sources not found (looked in {looked}): missing {', '.join(missing)}; "
            "reinstall a2ad or set A2AD_CSRC to a folder holding them"
        )
    try:
        archs = list(archs) if archs else cuda_archs()
    except ValueError as exc:
        raise errors.BuildError(f"A2AD_CUDA_ARCH: {exc}") from None
    arch = ",".join(archs)
    timing = timing_build()
    debug = debug_build()
    digest = build_hash(src, arch, timing, debug)
    defines = build_defines(timing, debug)
    out = build_dir(digest, root)
    name = f"a2ad_ext_{digest}"
    fresh = not (out.is_dir() and any(out.glob(f"{name}*.so")))
    if fresh:
        problems = toolchain_problems()
        if problems:
            raise errors.BuildError("cannot build the a2ad CUDA extension:\n" + "\n".join(f"  - {p}" for p in problems),
                                    arch=arch)
        kind = "".join(f" ({k} build)" for k, on in (("timing", timing), ("debug", debug)) if on)
        log(f"building the a2ad CUDA extension{kind} for {arch} (torch {torch.__version__}, CUDA {torch.version.cuda}) "
            f"from {src} into {out}; this takes about a minute ...")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(src / n) for n in SOURCES],
            extra_cflags=["-O3", *defines],
            extra_cuda_cflags=["-O3", *defines, *gencode_flags(archs)],
            extra_include_paths=[str(src)],
            build_directory=str(out),
            is_python_module=True,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        text = str(exc)
        tail = text[-ERROR_TAIL:]
        guessed = guessed_cuda_home_problem() if "cuda_runtime.h" in text else None
        if guessed:
            tail += f"\n{guessed}"
        raise errors.BuildError(
            f"building the a2ad CUDA extension in {out} failed:\n{tail}", build_dir=str(out), arch=arch
        ) from None
    if fresh:
        log(f"a2ad CUDA extension built in {time.monotonic() - started:.0f} s: {out}")
    if not hasattr(torch.ops.a2ad, "dispatch"):
        raise errors.BuildError(f"the a2ad extension in {out} loaded but registered no ops")
    missing = [f for f in ("dispatch", "combine", "sanitize", "quantize", "load_kernels") if not hasattr(module, f)]
    if missing:
        raise errors.BuildError(f"the a2ad extension in {out} loaded but its module lacks {', '.join(missing)}")
    return str(out), module


def build(archs: Sequence[str] | str | None = None, root: str | Path | None = None,
          log: Callable[[str], None] = _stderr) -> str:
    """Build (or find already built) the extension for *archs* under *root*; return its folder.

    For ``a2ad build-ext``; loads it into this process as well, as the build check."""
    global _loaded, _module
    targets = cuda_archs(archs)
    with _lock:
        path, module = _build_and_load(targets, Path(root) if root else None, log)
        if _loaded is None and root is None and targets == cuda_archs():
            _loaded, _module = path, module
    return path
