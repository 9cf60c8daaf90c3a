"""Map CUDA-backend rows contiguously: row q at ``base + q * row_stride``.

The client imports every rank's exported allocation (POSIX fds received over
SCM_RIGHTS, or 64-byte fabric handles), maps them into one reserved virtual
range and grants its own GPU read/write access to every row, including rows
whose memory sits on another GPU (peer access over NVLink: with the VMM API
that is ``cuMemSetAccess`` for the accessing device, no ``cuCtxEnablePeerAccess``).

All driver calls go through the device's *primary* context, the one torch
uses, so the resulting tensor is an ordinary torch CUDA tensor for kernels on
``cuda:device_ordinal``.

The tensor is built through DLPack with an explicit device: torch's
``__cuda_array_interface__`` import infers the device from the pointer, which
for a row that physically lives on another GPU may name that GPU. The mapping
object still exposes ``__cuda_array_interface__`` for other consumers.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from a2ad import cuda_driver as cd

# ---------------------------------------------------------------------------
# DLPack (legacy, unversioned DLManagedTensor; every torch since 1.10 takes it)
# ---------------------------------------------------------------------------
kDLCPU = 1
kDLCUDA = 2
kDLUInt = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DLDeleter),
]

_dl_lock = threading.Lock()
_dl_live: dict[int, tuple] = {}  # key -> (managed struct, shape, strides, owner)
_dl_next = [1]


def _dl_delete(managed) -> None:
    try:
        key = managed.contents.manager_ctx
        with _dl_lock:
            _dl_live.pop(key, None)
    except Exception:  # interpreter shutdown
        pass


_dl_deleter = _DLDeleter(_dl_delete)
_CAPSULE_NAME = b"dltensor"
# A function object of our own: ctypes.pythonapi.PyCapsule_New is one object shared by the
# whole process, and other libraries set its restype to their liking (FlashInfer's sets
# c_void_p, which would hand torch an int instead of a capsule).
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)


def _tensor_from_pointer(ptr: int, nbytes: int, device_type: int, device_id: int, owner) -> torch.Tensor:
    """A 1-D uint8 torch tensor over ``nbytes`` at ``ptr``, zero-copy; ``owner`` lives as long as it."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    strides = (ctypes.c_int64 * 1)(1)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr
    m.dl_tensor.device.device_type = device_type
    m.dl_tensor.device.device_id = device_id
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype.code = kDLUInt
    m.dl_tensor.dtype.bits = 8
    m.dl_tensor.dtype.lanes = 1
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = strides
    m.dl_tensor.byte_offset = 0
    with _dl_lock:
        key = _dl_next[0]
        _dl_next[0] += 1
        _dl_live[key] = (m, shape, strides, owner)
    m.manager_ctx = key
    m.deleter = _dl_deleter
    try:
        capsule = _PyCapsule_New(ctypes.addressof(m), _CAPSULE_NAME, None)
        return torch.from_dlpack(capsule)
    except BaseException:
        with _dl_lock:
            _dl_live.pop(key, None)
        raise


# ---------------------------------------------------------------------------
# The mapping
# ---------------------------------------------------------------------------
class _Resources:
    """Driver resources of one mapping; freed once (close(), or when nothing references it)."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.base: int | None = None
        self.total = 0
        self.mapped: list[tuple[int, int]] = []
        self.handles: list[int] = []
        self.lock = threading.Lock()

    def free(self) -> None:
        with self.lock:
            if self.base is None and not self.handles:
                return
            first: BaseException | None = None
            with cd.on_device(self.ordinal):
                try:
                    cd.synchronize()  # work queued on the range (any torch stream of this context) ends first
                except cd.CudaError as exc:
                    first = exc
                for ptr, size in reversed(self.mapped):
                    try:
                        cd.unmap(ptr, size)
                    except cd.CudaError as exc:
                        first = first or exc
                self.mapped = []
                for h in self.handles:
                    try:
                        cd.release(h)
                    except cd.CudaError as exc:
                        first = first or exc
                self.handles = []
                if self.base is not None:
                    try:
                        cd.address_free(self.base, self.total)
                    except cd.CudaError as exc:
                        first = first or exc
                    self.base = None
            if first is not None:
                raise first

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


class CudaMapping:
    """``[ep_size, size_per_rank]`` uint8 CUDA tensor over ep_size imported rows, ``stride(0) == row_stride``.

    ``handles`` are, per rank, a POSIX fd (int; imported, never closed here: the
    caller closes its fds once the mapping exists) or a 64-byte fabric handle.
    ``row_stride`` is the daemon's allocation size per row (a multiple of the
    allocation granularity). ``device_ordinal`` is this process's device
    (torch's ``cuda:N``; default: torch's current device); it gets read/write
    access to every row. ``access_devices`` overrides the list of devices
    granted access.

    The tensor (and every view of it) keeps the mapping's driver resources
    alive; :meth:`close` frees them at once regardless (views become invalid,
    as with ``HostMapping``).
    """

    def __init__(
        self,
        handles: list,
        size_per_rank: int,
        row_stride: int,
        device_ordinal: int | None = None,
        access_devices: list[int] | None = None,
    ):
        if not handles:
            raise ValueError("CudaMapping needs at least one row")
        if not 0 < size_per_rank <= row_stride:
            raise ValueError(f"size_per_rank ({size_per_rank}) must be in (0, row_stride={row_stride}]")
        if device_ordinal is None:
            device_ordinal = torch.cuda.current_device()
        self.device_ordinal = int(device_ordinal)
        self.device = torch.device("cuda", self.device_ordinal)
        self.ep_size = len(handles)
        self.size_per_rank = int(size_per_rank)
        self.row_stride = int(row_stride)
        gran = cd.granularity(self.device_ordinal)
        if self.row_stride % gran:
            raise ValueError(
                f"row_stride {self.row_stride} is not a multiple of the allocation granularity {gran} "
                f"of device {self.device_ordinal}"
            )
        access = [self.device_ordinal] if access_devices is None else [int(d) for d in access_devices]
        res = _Resources(self.device_ordinal)
        try:
            with cd.on_device(self.device_ordinal):
                res.total = self.ep_size * self.row_stride
                res.base = cd.reserve(res.total, gran)
                for q, h in enumerate(handles):
                    if isinstance(h, (bytes, bytearray, memoryview)):
                        imported = cd.import_fabric(bytes(h))
                    else:
                        imported = cd.import_fd(int(h))
                    res.handles.append(imported)
                    ptr = res.base + q * self.row_stride
                    cd.map(ptr, self.row_stride, imported)
                    res.mapped.append((ptr, self.row_stride))
                    cd.set_access(ptr, self.row_stride, access)
        except BaseException:
            res.free()
            raise
        self._res = res
        self.base_ptr = res.base
        self._access = access
        # what checkpoint_prepare / checkpoint_restore need to import the rows again
        self._rows = [bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else os.dup(int(h)) for h in handles]
        self.suspended = False
        try:
            flat = _tensor_from_pointer(res.base, res.total, kDLCUDA, self.device_ordinal, res)
            if flat.device != self.device or flat.data_ptr() != res.base:
                raise cd.CudaError(
                    "torch.from_dlpack",
                    None,
                    f"tensor landed on {flat.device} at {flat.data_ptr():#x}, wanted {self.device} at {res.base:#x}",
                )
        except BaseException:
            flat = None
            res.free()
            raise
        self.flat = flat
        self.tensor = self.flat.as_strided((self.ep_size, self.size_per_rank), (self.row_stride, 1))

    @property
    def closed(self) -> bool:
        return self._res is None

    def row_ptr(self, rank: int) -> int:
        if not 0 <= rank < self.ep_size:
            raise IndexError(f"rank {rank} out of range for ep_size {self.ep_size}")
        return self.base_ptr + rank * self.row_stride

    @property
    def __cuda_array_interface__(self) -> dict:
        if self._res is None:
            raise ValueError("mapping is closed")
        return {
            "shape": (self.ep_size, self.size_per_rank),
            "typestr": "|u1",
            "data": (self.base_ptr, False),
            "strides": (self.row_stride, 1),
            "version": 3,
        }

    def suspend(self) -> None:
        """Synchronize the device, unmap every row and release the imported handles, keeping the
        reserved address range (and so every pointer into it). Idempotent."""
        res = self._res
        if res is None or self.suspended:
            return
        with res.lock, cd.on_device(self.device_ordinal):
            cd.synchronize()
            for ptr, size in reversed(res.mapped):
                cd.unmap(ptr, size)
            res.mapped = []
            for h in res.handles:
                cd.release(h)
            res.handles = []
        self.suspended = True

    def resume(self) -> None:
        """Import every row again and map it at the address it had. Idempotent."""
        res = self._res
        if res is None or not self.suspended:
            return
        with res.lock, cd.on_device(self.device_ordinal):
            for q, h in enumerate(self._rows):
                imported = cd.import_fabric(h) if isinstance(h, bytes) else cd.import_fd(h)
                res.handles.append(imported)
                ptr = res.base + q * self.row_stride
                cd.map(ptr, self.row_stride, imported)
                res.mapped.append((ptr, self.row_stride))
                cd.set_access(ptr, self.row_stride, self._access)
        self.suspended = False

    def close(self) -> None:
        """Synchronize the device, unmap, release the imported handles, free the range. Idempotent."""
        for row in getattr(self, "_rows", ()):
            if isinstance(row, int):
                os.close(row)
        self._rows = []
        res, self._res = getattr(self, "_res", None), None
        self.tensor = None
        self.flat = None
        if res is not None:
            res.free()

    def __enter__(self) -> "CudaMapping":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._res is None else f"base={self.base_ptr:#x}"
        return (
            f"CudaMapping(ep_size={self.ep_size}, size_per_rank={self.size_per_rank}, "
            f"row_stride={self.row_stride}, device=cuda:{self.device_ordinal}, {state})"
        )
