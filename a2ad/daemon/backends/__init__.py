"""Memory backends: where the daemon allocates workspaces (see base.Backend)."""

from __future__ import annotations

from a2ad import errors
from a2ad.daemon.backends.base import Allocation, Backend


def cuda_available() -> bool:
    """True when the CUDA driver library loads and reports at least one device."""
    try:
        from a2ad import cuda_driver
    except Exception:
        return False
    try:
        return cuda_driver.device_count() > 0
    except Exception:
        return False


def make_backend(name: str) -> Backend:
    """``host``, ``cuda`` or ``auto`` (cuda when a GPU is present, else host)."""
    if name == "auto":
        name = "cuda" if cuda_available() else "host"
    if name == "host":
        from a2ad.daemon.backends.host import HostBackend

        return HostBackend()
    if name == "cuda":
        if not cuda_available():
            raise errors.BackendError(
                "--backend cuda needs an NVIDIA driver and at least one GPU; none was found "
                "(use --backend host or auto on machines without a GPU)"
            )
        from a2ad.daemon.backends.cuda import CudaBackend

        return CudaBackend()
    raise errors.InvalidField(f"unknown backend {name!r}; choose host, cuda or auto", field="backend")


__all__ = ["Allocation", "Backend", "make_backend", "cuda_available"]
