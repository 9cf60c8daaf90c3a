"""CUDA backend: one ``cuMemCreate`` allocation per rank row, exported as a POSIX fd.

The daemon allocates each rank's row on the GPU that rank declared (by UUID),
exports a POSIX file descriptor for it (what clients import over SCM_RIGHTS),
and keeps both the fd and its own allocation handle until the job is freed.
Where the driver permits it (an IMEX channel exists) the allocation is also
made exportable as a fabric handle; the 64 handle bytes then sit in
``Allocation.extra['fabric_handle']`` and ``Allocation.handle_type`` is
``'fabric'``. The POSIX fd is exported either way: on one node it is what
clients use.

The daemon never launches kernels and never imports torch: driver calls go
through :mod:`a2ad.cuda_driver` (NVIDIA's cuda-bindings, the ``a2ad[cuda]``
extra). Creating, exporting and releasing VMM allocations needs no CUDA
context; only :meth:`CudaBackend.initialize` (a memset and a 4-byte copy
through a temporary mapping) does. A CUDA context costs about 524 MiB of HBM per GPU on H200
(driver 580), so by default the backend creates the device's primary context
for the initialization and releases it right after ("transient" policy: the
daemon holds no GPU memory beyond the workspaces between setups, at the price
of a context creation per initialization). ``keep_context=True`` (or
``A2AD_CUDA_KEEP_CONTEXT=1``) keeps it instead. The memory and time of every
context creation are measured (see :meth:`CudaBackend.describe`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

from a2ad import cuda_driver as cd
from a2ad import errors
from a2ad.daemon.backends.base import Allocation, Backend, check_tail, init_words

#: Where the driver exposes IMEX channels (``channelN`` device nodes); a process needs one to
#: allocate or import memory with fabric handles.
IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"


def imex_channels(folder: str = IMEX_CHANNEL_DIR) -> list[str]:
    """The IMEX channel device nodes this process can open read-write, e.g. ``['channel0']``."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("channel"))
    except OSError:
        return []
    return [n for n in names if os.access(os.path.join(folder, n), os.R_OK | os.W_OK)]


def fabric_missing_reason(device: str, why: str | None, folder: str = IMEX_CHANNEL_DIR) -> str:
    """Why rows on ``device`` have no fabric handle, naming the IMEX channel they need: the
    text a job that spans nodes is refused with."""
    chans = imex_channels(folder)
    where = (f"this node has {', '.join(os.path.join(folder, c) for c in chans)}, yet the driver refused"
             if chans else "none is usable on this node")
    return (f"GPU {device} cannot export fabric handles ({why or 'not granted'}): fabric handles need an IMEX "
            f"channel ({folder}/channelN, readable and writable by the daemon and its workers) and the "
            f"nvidia-imex service of the NVLink domain running on every node; {where}")


class CudaBackend(Backend):
    name = "cuda"
    lines_tail = True

    def __init__(self, try_fabric: bool = True, keep_context: bool | None = None):
        self._lock = threading.RLock()
        self._try_fabric = try_fabric and os.environ.get("A2AD_CUDA_FABRIC", "1") != "0"
        if keep_context is None:
            keep_context = os.environ.get("A2AD_CUDA_KEEP_CONTEXT", "0") == "1"
        self._keep_context = bool(keep_context)
        self._handle_type: str | None = None
        self._granularity: dict[int, int] = {}
        self._workspace_bytes: dict[int, int] = {}
        self._live = 0

    # --- devices --------------------------------------------------------------
    def _ordinal(self, device) -> int:
        if not isinstance(device, str):
            raise errors.InvalidField(f"device must be a GPU UUID string, got {type(device).__name__}", field="device")
        if device == "host":
            raise errors.InvalidField(
                "this daemon runs the cuda backend; device must be the UUID of the rank's GPU "
                "(GPU-xxxxxxxx-..., as `nvidia-smi -L` prints), got 'host'",
                field="device",
            )
        try:
            return cd.device_by_uuid(device)
        except (ValueError, LookupError) as exc:
            raise errors.InvalidField(str(exc), field="device") from None

    def check_device(self, device: str) -> None:
        ordinal = self._ordinal(device)
        if not cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, ordinal):
            raise errors.BackendError(f"GPU {device} does not support CUDA virtual memory management (cuMemCreate)")
        if not cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, ordinal):
            raise errors.BackendError(f"GPU {device} cannot export memory as a POSIX file descriptor")

    def _gran(self, ordinal: int) -> int:
        g = self._granularity.get(ordinal)
        if g is None:
            posix = cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            g = math.lcm(cd.granularity(ordinal, posix), cd.granularity(ordinal, posix, recommended=True))
            if self._try_fabric:
                both = posix | cd.CU_MEM_HANDLE_TYPE_FABRIC
                try:
                    g = math.lcm(g, cd.granularity(ordinal, both), cd.granularity(ordinal, both, recommended=True))
                except cd.CudaError:
                    pass  # fabric not supported here: creation will fall back anyway
            self._granularity[ordinal] = g
        return g

    def row_stride(self, size_per_rank: int, device: str) -> int:
        g = self._gran(self._ordinal(device))
        return max(1, -(-int(size_per_rank) // g)) * g

    # --- contexts ---------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self):
        """Keep each device's context across the block (a re-arm initializes every row: one
        context creation per device, about 0.1 s each, instead of one per row); afterwards the
        transient policy releases them as usual."""
        keep = self._keep_context
        self._keep_context = True
        try:
            yield
        finally:
            self._keep_context = keep
            if not keep:
                with self._lock:
                    cd.release_primary_contexts()

    @contextlib.contextmanager
    def _context(self, ordinal: int):
        """The device's primary context, current for the block; released after unless kept."""
        try:
            with cd.on_device(ordinal):
                yield
        finally:
            if not self._keep_context:
                try:
                    cd.release_primary_context(ordinal)
                except cd.CudaError:
                    pass

    def _contextless(self, ordinal: int, fn):
        """Run a VMM call with no context; should a driver want one after all, retry inside one."""
        try:
            return fn()
        except cd.CudaError as exc:
            if exc.result not in (cd.CUDA_ERROR_INVALID_CONTEXT, cd.CUDA_ERROR_NOT_INITIALIZED):
                raise
        with self._context(ordinal):
            return fn()

    # --- rows -----------------------------------------------------------------
    def allocate(self, size_per_rank: int, device: str) -> Allocation:
        ordinal = self._ordinal(device)
        size = self.row_stride(size_per_rank, device)
        types_wanted = None if self._try_fabric else cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with self._lock:
            handle, types = self._contextless(ordinal, lambda: cd.create(size, ordinal, types_wanted))
            try:
                fd = self._contextless(ordinal, lambda: cd.export_fd(handle))
            except BaseException:
                cd.release(handle)
                raise
            extra: dict = {"handle": handle, "ordinal": ordinal, "uuid": cd.uuid_of(ordinal), "handle_types": types}
            handle_type = "posix_fd"
            if types & cd.CU_MEM_HANDLE_TYPE_FABRIC:
                try:
                    extra["fabric_handle"] = cd.export_fabric(handle)
                    handle_type = "fabric"
                except cd.CudaError as exc:
                    extra["fabric_error"] = fabric_missing_reason(device, exc.message)
            else:
                refused = cd.fabric_refusal(ordinal)
                extra["fabric_error"] = fabric_missing_reason(
                    device, "A2AD_CUDA_FABRIC=0" if not self._try_fabric
                    else f"cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC: {refused.result_name}" if refused else None)
            self._handle_type = handle_type
            self._workspace_bytes[ordinal] = self._workspace_bytes.get(ordinal, 0) + size
            self._live += 1
        return Allocation(fd=fd, size=size, device=device, handle_type=handle_type, extra=extra)

    def enable_fabric(self) -> None:
        """Rows already try for fabric handles (unless A2AD_CUDA_FABRIC=0); nothing to switch on."""

    def adopt(self, fd: int, size: int, device: str, handle_type: str, fabric: bytes | None = None) -> Allocation:
        """Re-import a row from the fd a previous daemon exported (the memory lives on in
        its importers and in this fd; importing gives this daemon a handle to map and release).
        ``fabric``: the row's fabric handle as the previous daemon exported it (the
        allocation is the same, so the handle still names it)."""
        ordinal = self._ordinal(device)
        with self._lock:
            handle = self._contextless(ordinal, lambda: cd.import_fd(fd))
            self._workspace_bytes[ordinal] = self._workspace_bytes.get(ordinal, 0) + size
            self._live += 1
        extra = {"handle": handle, "ordinal": ordinal, "uuid": cd.uuid_of(ordinal), "adopted": True}
        if fabric is not None and len(fabric) == cd.FABRIC_HANDLE_SIZE:
            extra["fabric_handle"] = bytes(fabric)
        elif handle_type == "fabric":
            extra["fabric_error"] = fabric_missing_reason(device, "its fabric handle was not kept across the restart")
        else:
            extra["fabric_error"] = fabric_missing_reason(device, "the row was allocated without one")
        return Allocation(fd=fd, size=size, device=device, handle_type=handle_type, extra=extra)

    def initialize(
        self, alloc: Allocation, aux_bytes: int, flag_offset: int, initial_round: int, fresh: bool = False,
        words: dict[int, int] | None = None, tail: int = 0,
    ) -> None:
        # ``fresh`` is ignored: cuMemCreate memory is not guaranteed zero, so every
        # initialization memsets the aux region on the GPU (no host memory is involved).
        handle = alloc.extra.get("handle")
        if handle is None:
            raise errors.BackendError("initialize() of a released CUDA allocation")
        if not 0 <= aux_bytes <= alloc.size:
            raise errors.BackendError(f"aux region of {aux_bytes} bytes does not fit a row of {alloc.size}")
        check_tail(tail, aux_bytes, alloc.size)
        writes = init_words(flag_offset, initial_round, words, aux_bytes, alloc.size)
        ordinal = alloc.extra["ordinal"]
        with self._lock, self._context(ordinal):
            ptr = cd.reserve(alloc.size, cd.granularity(ordinal))
            try:
                cd.map(ptr, alloc.size, handle)
                try:
                    cd.set_access(ptr, alloc.size, ordinal)
                    if aux_bytes:
                        cd.memset_d8(ptr, 0, aux_bytes)
                    if tail:
                        cd.memset_d8(ptr + alloc.size - tail, 0, tail)
                    for off, data in writes:
                        cd.memcpy_htod(ptr + off, data)
                    cd.synchronize()
                finally:
                    cd.unmap(ptr, alloc.size)
            finally:
                cd.address_free(ptr, alloc.size)

    def release(self, alloc: Allocation) -> None:
        if alloc.fd >= 0:
            os.close(alloc.fd)
            alloc.fd = -1
        handle = alloc.extra.pop("handle", None)
        if handle is None:
            return
        ordinal = alloc.extra["ordinal"]
        with self._lock:
            self._contextless(ordinal, lambda: cd.release(handle))
            self._workspace_bytes[ordinal] = self._workspace_bytes.get(ordinal, 0) - alloc.size
            self._live -= 1

    # --- limits -----------------------------------------------------------------
    #: 90% of the visible GPUs' memory by default (see base.default_limits).
    default_share = 0.9

    def memory_capacity(self) -> int:
        """Total memory of the visible GPUs (cuDeviceTotalMem summed over the devices the driver
        reports, i.e. after CUDA_VISIBLE_DEVICES); 0 when the driver cannot tell."""
        try:
            return sum(cd.total_memory(i) for i in range(cd.device_count()))
        except cd.CudaError:
            return 0

    # --- status -----------------------------------------------------------------
    def describe(self) -> dict:
        out: dict = {
            "backend": self.name,
            "handle_type": self._handle_type or "posix_fd",
            "context_policy": "kept" if self._keep_context else "transient",
        }
        try:
            out["driver_version"] = cd.driver_version()
            n = cd.device_count()
        except cd.CudaError as exc:
            out["error"] = exc.message
            return out
        devices = []
        for i in range(n):
            entry: dict = {"ordinal": i}
            try:
                entry["uuid"] = cd.uuid_of(i)
                entry["name"] = cd.device_name(i)
            except cd.CudaError as exc:
                entry["error"] = exc.message
            try:
                entry["context_active"] = cd.primary_context_active(i)
            except cd.CudaError:
                entry["context_active"] = None
            info = cd.context_overhead(i)
            # measured at the latest creation of the daemon's context on this GPU (None: never created)
            entry["context_overhead_bytes"] = info["bytes"] if info else None
            if info:
                entry["context_creations"] = info.get("creations", 0)
                if info.get("seconds") is not None:
                    entry["context_create_seconds"] = round(info["seconds"], 4)
                if info["bytes"] is None:
                    entry["context_overhead_note"] = info["note"]
            entry["workspace_bytes"] = self._workspace_bytes.get(i, 0)
            refused = cd.fabric_refusal(i)
            if refused is not None:
                entry["fabric_refused"] = refused.result_name
            devices.append(entry)
        out["devices"] = devices
        return out

    def close(self) -> None:
        # No mapping outlives initialize(), and allocations do not need a context.
        with self._lock:
            try:
                cd.release_primary_contexts()
            except cd.CudaError:
                pass
