"""Memory backends: where the daemon allocates workspaces (see base.Backend)."""

from __future__ import annotations

import logging
import os

from a2ad import errors
from a2ad.daemon.backends.base import Allocation, Backend

log = logging.getLogger("a2ad")


def cuda_unavailable_reason() -> str | None:
    """None when the cuda backend can run here, else why not.

    It can when cuda-bindings imports and the CUDA driver loads and reports at
    least one device. Probing imports cuda.bindings (never torch); without it,
    this answers the reason instead of failing.
    """
    try:
        from a2ad import cuda_driver

        why = cuda_driver.unavailable()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if why is None else why.message


def cuda_available() -> bool:
    """True when cuda-bindings imports and the CUDA driver loads and reports at least one device."""
    return cuda_unavailable_reason() is None


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


def make_backend(name: str) -> Backend:
    """``host``, ``cuda`` or ``auto`` (cuda when a GPU is usable, else host)."""
    if name == "auto":
        why = cuda_unavailable_reason()
        name = "cuda" if why is None else "host"
        if why is not None and _nvidia_driver_present():
            # e.g. cuda-bindings not installed on a GPU node: say so rather than fall back silently
            log.warning("backend auto: the host backend, although an NVIDIA driver is loaded: %s", why)
    if name == "host":
        from a2ad.daemon.backends.host import HostBackend

        return HostBackend()
    if name == "cuda":
        why = cuda_unavailable_reason()
        if why is not None:
            raise errors.BackendError(
                "--backend cuda needs the cuda-bindings package, an NVIDIA driver and at least one GPU: "
                f"{why} (use --backend host or auto on machines without a GPU)"
            )
        from a2ad.daemon.backends.cuda import CudaBackend

        return CudaBackend()
    raise errors.InvalidField(f"unknown backend {name!r}; choose host, cuda or auto", field="backend")


__all__ = ["Allocation", "Backend", "make_backend", "cuda_available", "cuda_unavailable_reason"]
