"""What every part of the bench shares: the implementations' names and how each is timed,
the environment that keeps NVLink multicast off, logging, and making ``a2ad.client`` importable."""

from __future__ import annotations

import sys
from pathlib import Path


SCHEMA = "a2ad-bench/1"
#: The grid: tokens per rank and hidden sizes of a full run, of --quick and of --dry-run.
FULL_TOKENS = (1, 8, 32, 128, 512, 1024, 4096)
QUICK_TOKENS = (1, 128, 4096)
DEFAULT_HIDDEN = (7168, 4096, 2880)
DRY_TOKENS = (1, 8, 64)
DRY_HIDDEN = (256,)
IMPLS = ("a2ad", "a2ad-eager", "flashinfer", "flashinfer-eager", "nccl", "agrs")
IMPL_LABELS = {
    "a2ad": "a2ad (CUDA graph)",
    "a2ad-eager": "a2ad (eager API)",
    "flashinfer": "FlashInfer MoeAlltoAll (CUDA graph)",
    "flashinfer-eager": "FlashInfer MoeAlltoAll (eager API)",
    "nccl": "NCCL all_to_all (Megatron, eager)",
    "agrs": "NCCL all-gather + reduce-scatter (eager)",
}
#: How each implementation is timed: replays of CUDA graphs, or eager calls.
IMPL_MODE = {"a2ad": "graph", "a2ad-eager": "eager", "flashinfer": "graph", "flashinfer-eager": "eager",
             "nccl": "eager", "agrs": "eager"}
#: A remark printed next to an implementation's rows.
IMPL_NOTES = {
    "nccl": "eager only: cannot be captured (its splits need a host sync)",
    "agrs": "eager",
}
#: The graph row an eager row is compared with (eager overhead = eager pair - graph pair).
EAGER_OF = {"a2ad-eager": "a2ad", "flashinfer-eager": "flashinfer"}
#: Never use NVLink multicast / NVLS on the lent machines.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def log(msg: str) -> None:
    print(f"[a2ad-bench] {msg}", file=sys.stderr, flush=True)


def ensure_client_package() -> str | None:
    """Make ``a2ad.client`` importable in a checkout that was not pip-installed (the mapping of
    ``client/`` to ``a2ad.client`` lives in pyproject.toml); returns what is missing, or None."""
    missing = [m for m in ("zmq", "msgpack") if __import__("importlib").util.find_spec(m) is None]
    if missing:
        names = {"zmq": "pyzmq", "msgpack": "msgpack"}
        return (f"the a2ad client needs {' and '.join(names[m] for m in missing)}: install "
                f"{' '.join(names[m] for m in missing)} (on a machine without a registry, carry the wheels)")
    try:
        import a2ad.client  # noqa: F401

        return None
    except ModuleNotFoundError as exc:
        if exc.name not in ("a2ad.client",):
            return f"cannot import a2ad.client: {exc}"
    import importlib.util

    import a2ad

    root = Path(a2ad.__file__).resolve().parent.parent / "client"
    if not (root / "__init__.py").is_file():
        return "a2ad.client is not importable: run `pip install -e .` in the repository (scripts/setup.sh)"
    spec = importlib.util.spec_from_file_location("a2ad.client", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["a2ad.client"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["a2ad.client"]
        raise
    a2ad.client = mod
    return None


class Skip(Exception):
    """An implementation that cannot run in this configuration (not an error)."""


def exception_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception, and of the one it was raised while handling
    (``torch.cuda.graph`` ends a failed capture in ``__exit__``, which may raise again)."""
    def one(e):
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0][:limit] if text else ''}".rstrip(": ")
    out = one(exc)
    ctx_exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if ctx_exc is not None:
        out += f" (while handling {one(ctx_exc)})"
    return out
