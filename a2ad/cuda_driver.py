"""A small ctypes wrapper over the CUDA driver API (``libcuda.so.1``).

The daemon uses this instead of torch so that it never creates a torch CUDA
context; clients use it next to torch (both share the device's primary
context). Only what a2ad needs is wrapped: device discovery, primary contexts,
the virtual-memory-management (VMM) calls (``cuMemCreate``, export/import of
shareable handles, ``cuMemAddressReserve``/``cuMemMap``/``cuMemSetAccess``),
a synchronous memset/memcpy for initialization, host-memory registration, and
``cuMemGetInfo``.

Nothing is loaded at import time: the library is opened and ``cuInit`` is
called on first use, so importing this module on a machine without a driver is
always safe. :func:`device_count` answers 0 there; everything else raises
:class:`CudaUnavailable` (a :class:`~a2ad.errors.BackendError`).

Struct layouts follow ``cuda.h`` of CUDA 13.0 (they are unchanged since the VMM
API appeared in CUDA 10.2; ``CUmemAllocationProp`` is 32 bytes,
``CUmemAccessDesc`` 12). Versioned entry points are called by their real symbol
names (``cuMemGetInfo_v2``, ``cuDeviceGetUuid_v2``, ...), as ``cuda.h``'s
``#define`` s would.

Device numbering: a *device ordinal* here is the driver's ordinal in this
process, which honours ``CUDA_VISIBLE_DEVICES`` exactly as the CUDA runtime
(and so torch's ``cuda:N``) does. Between processes, devices are named by UUID.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import threading
import time

from . import errors

# ---------------------------------------------------------------------------
# Constants (values from cuda.h)
# ---------------------------------------------------------------------------
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801

#: Fallback names, used when cuGetErrorName itself is unavailable.
_RESULT_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    208: "CUDA_ERROR_ALREADY_MAPPED",
    217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}

# CUmemAllocationHandleType
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8
# CUmemAllocationType / CUmemLocationType
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
# CUmemAccess_flags
CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
# CUmemAllocationGranularity_flags
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
# cuMemHostRegister flags
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
# CUdevice_attribute (the few used here)
CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128
# CUpointer_attribute
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9

#: Size of a CUmemFabricHandle (CU_IPC_HANDLE_SIZE).
FABRIC_HANDLE_SIZE = 64

#: cuMemCreate results after which an allocation that asked for a fabric handle
#: is retried with the POSIX-fd handle type alone.
FABRIC_FALLBACK_RESULTS = frozenset({CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE})

HANDLE_TYPE_NAMES = {
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: "posix_fd",
    CU_MEM_HANDLE_TYPE_FABRIC: "fabric",
}


# ---------------------------------------------------------------------------
# Structs (cuda.h)
# ---------------------------------------------------------------------------
class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUmemLocation(ctypes.Structure):
    # { CUmemLocationType type; int id; }  -> 8 bytes
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    # { unsigned char compressionType; unsigned char gpuDirectRDMACapable;
    #   unsigned short usage; unsigned char reserved[4]; } -> 8 bytes
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    # type @0, requestedHandleTypes @4, location @8 (8 bytes),
    # win32HandleMetaData @16 (pointer), allocFlags @24 (8 bytes) -> 32 bytes
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    # { CUmemLocation location; CUmemAccess_flags flags; } -> 12 bytes
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUmemFabricHandle(ctypes.Structure):
    _fields_ = [("data", ctypes.c_ubyte * FABRIC_HANDLE_SIZE)]


assert ctypes.sizeof(CUmemLocation) == 8
assert ctypes.sizeof(CUmemAllocationProp) == 32
assert CUmemAllocationProp.win32HandleMetaData.offset == 16
assert CUmemAllocationProp.allocFlags.offset == 24
assert ctypes.sizeof(CUmemAccessDesc) == 12
assert ctypes.sizeof(CUmemFabricHandle) == 64


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------
class CudaError(errors.BackendError):
    """A driver call failed. ``function`` is the API name, ``result`` the CUresult."""

    def __init__(self, function: str, result: int | None, detail: str = ""):
        name = error_name(result) if result is not None else "unavailable"
        msg = f"{function} failed: {name}"
        if result is not None:
            msg += f" ({result})"
            desc = _error_string(result)
            if desc:
                msg += f" [{desc}]"
        if detail:
            msg += f": {detail}"
        super().__init__(msg, function=function, cuda_result=result, cuda_error=name)
        self.function = function
        self.result = result
        self.result_name = name


class CudaUnavailable(CudaError):
    """There is no usable CUDA driver (library missing, stub library, no device)."""

    def __init__(self, detail: str, result: int | None = None, function: str = "libcuda"):
        super().__init__(function, result, detail)
        why = f" ({function}: {self.result_name})" if result is not None else ""
        self.message = f"CUDA is unavailable{why}: {detail}"
        self.args = (self.message,)


# ---------------------------------------------------------------------------
# Library loading and prototypes
# ---------------------------------------------------------------------------
_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_uint_p = ctypes.POINTER(ctypes.c_uint)
_c_size_t_p = ctypes.POINTER(ctypes.c_size_t)
_c_u64 = ctypes.c_uint64  # CUdeviceptr, CUmemGenericAllocationHandle
_c_u64_p = ctypes.POINTER(ctypes.c_uint64)
_c_char_p_p = ctypes.POINTER(ctypes.c_char_p)

# python name -> (exported symbol, argtypes)
_PROTOS: dict[str, tuple[str, list]] = {
    "cuInit": ("cuInit", [ctypes.c_uint]),
    "cuDriverGetVersion": ("cuDriverGetVersion", [_c_int_p]),
    "cuGetErrorName": ("cuGetErrorName", [ctypes.c_int, _c_char_p_p]),
    "cuGetErrorString": ("cuGetErrorString", [ctypes.c_int, _c_char_p_p]),
    "cuDeviceGetCount": ("cuDeviceGetCount", [_c_int_p]),
    "cuDeviceGet": ("cuDeviceGet", [_c_int_p, ctypes.c_int]),
    "cuDeviceGetName": ("cuDeviceGetName", [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
    "cuDeviceGetUuid": ("cuDeviceGetUuid_v2", [ctypes.POINTER(CUuuid), ctypes.c_int]),
    "cuDeviceGetAttribute": ("cuDeviceGetAttribute", [_c_int_p, ctypes.c_int, ctypes.c_int]),
    "cuDeviceTotalMem": ("cuDeviceTotalMem_v2", [_c_size_t_p, ctypes.c_int]),
    "cuDeviceCanAccessPeer": ("cuDeviceCanAccessPeer", [_c_int_p, ctypes.c_int, ctypes.c_int]),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
    "cuDevicePrimaryCtxRelease": ("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int]),
    "cuDevicePrimaryCtxGetState": ("cuDevicePrimaryCtxGetState", [ctypes.c_int, _c_uint_p, _c_int_p]),
    "cuCtxSetCurrent": ("cuCtxSetCurrent", [ctypes.c_void_p]),
    "cuCtxGetCurrent": ("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
    "cuCtxPushCurrent": ("cuCtxPushCurrent_v2", [ctypes.c_void_p]),
    "cuCtxPopCurrent": ("cuCtxPopCurrent_v2", [ctypes.POINTER(ctypes.c_void_p)]),
    "cuCtxSynchronize": ("cuCtxSynchronize", []),
    "cuMemGetInfo": ("cuMemGetInfo_v2", [_c_size_t_p, _c_size_t_p]),
    "cuMemGetAllocationGranularity": (
        "cuMemGetAllocationGranularity",
        [_c_size_t_p, ctypes.POINTER(CUmemAllocationProp), ctypes.c_int],
    ),
    "cuMemCreate": (
        "cuMemCreate",
        [_c_u64_p, ctypes.c_size_t, ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
    ),
    "cuMemRelease": ("cuMemRelease", [_c_u64]),
    "cuMemExportToShareableHandle": (
        "cuMemExportToShareableHandle",
        [ctypes.c_void_p, _c_u64, ctypes.c_int, ctypes.c_ulonglong],
    ),
    "cuMemImportFromShareableHandle": (
        "cuMemImportFromShareableHandle",
        [_c_u64_p, ctypes.c_void_p, ctypes.c_int],
    ),
    "cuMemAddressReserve": (
        "cuMemAddressReserve",
        [_c_u64_p, ctypes.c_size_t, ctypes.c_size_t, _c_u64, ctypes.c_ulonglong],
    ),
    "cuMemAddressFree": ("cuMemAddressFree", [_c_u64, ctypes.c_size_t]),
    "cuMemMap": ("cuMemMap", [_c_u64, ctypes.c_size_t, ctypes.c_size_t, _c_u64, ctypes.c_ulonglong]),
    "cuMemUnmap": ("cuMemUnmap", [_c_u64, ctypes.c_size_t]),
    "cuMemSetAccess": (
        "cuMemSetAccess",
        [_c_u64, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc), ctypes.c_size_t],
    ),
    "cuMemsetD8": ("cuMemsetD8_v2", [_c_u64, ctypes.c_ubyte, ctypes.c_size_t]),
    "cuMemcpyHtoD": ("cuMemcpyHtoD_v2", [_c_u64, ctypes.c_void_p, ctypes.c_size_t]),
    "cuMemcpyDtoH": ("cuMemcpyDtoH_v2", [ctypes.c_void_p, _c_u64, ctypes.c_size_t]),
    "cuMemHostRegister": ("cuMemHostRegister_v2", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
    "cuMemHostUnregister": ("cuMemHostUnregister", [ctypes.c_void_p]),
    "cuMemHostGetDevicePointer": ("cuMemHostGetDevicePointer_v2", [_c_u64_p, ctypes.c_void_p, ctypes.c_uint]),
    "cuPointerGetAttribute": ("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int, _c_u64]),
}

_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_fns: dict[str, object] = {}
_initialized = False
_init_result: int | None = None


def _library_name() -> str:
    return os.environ.get("A2AD_LIBCUDA", "libcuda.so.1")


def _load() -> ctypes.CDLL:
    global _lib, _load_error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        if _load_error is not None:
            raise CudaUnavailable(_load_error)
        name = _library_name()
        try:
            _lib = ctypes.CDLL(name)
        except OSError as exc:
            _load_error = f"the CUDA driver library {name} could not be loaded ({exc}); is the NVIDIA driver installed?"
            raise CudaUnavailable(_load_error) from None
        return _lib


def _fn(name: str):
    f = _fns.get(name)
    if f is not None:
        return f
    lib = _load()
    symbol, argtypes = _PROTOS[name]
    try:
        f = getattr(lib, symbol)
    except AttributeError:
        raise CudaUnavailable(f"the driver library lacks {symbol} (driver too old?)", function=name) from None
    f.restype = ctypes.c_int
    f.argtypes = argtypes
    _fns[name] = f
    return f


def _error_string(result: int) -> str:
    if _lib is None:
        return ""
    try:
        s = ctypes.c_char_p()
        if _fn("cuGetErrorString")(result, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode(errors="replace")
    except Exception:
        pass
    return ""


def error_name(result: int) -> str:
    """``CUDA_ERROR_...`` name of a CUresult (cuGetErrorName, or a built-in table)."""
    if _lib is not None:
        try:
            s = ctypes.c_char_p()
            if _fn("cuGetErrorName")(result, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
                return s.value.decode(errors="replace")
        except Exception:
            pass
    return _RESULT_NAMES.get(result, f"CUresult {result}")


def _call(name: str, *args, detail: str = "") -> None:
    r = _fn(name)(*args)
    if r != CUDA_SUCCESS:
        raise CudaError(name, r, detail)


def _raw(name: str, *args) -> int:
    """Call without raising; returns the CUresult."""
    return _fn(name)(*args)


# ---------------------------------------------------------------------------
# Initialization and devices
# ---------------------------------------------------------------------------
def init() -> None:
    """``cuInit(0)`` once per process. Raises CudaUnavailable when there is no usable driver/device."""
    global _initialized, _init_result
    if _initialized:
        return
    with _lock:
        if _initialized:
            return
        if _init_result is not None:  # failed before: answer the same way
            raise _init_failure(_init_result)
        r = _raw("cuInit", 0)
        if r != CUDA_SUCCESS:
            _init_result = r
            raise _init_failure(r)
        _initialized = True


def _init_failure(r: int) -> CudaError:
    if r == CUDA_ERROR_NO_DEVICE:
        return CudaUnavailable("no CUDA-capable device is visible to this process", r, "cuInit")
    if r == CUDA_ERROR_STUB_LIBRARY:
        return CudaUnavailable("libcuda.so.1 is the toolkit's stub library, not a real driver", r, "cuInit")
    return CudaError("cuInit", r)


def available() -> bool:
    """True when the driver loads, initializes and reports at least one device."""
    try:
        return device_count() > 0
    except Exception:
        return False


def device_count() -> int:
    """Number of visible devices; 0 when the driver library is missing or reports no device.

    Other driver failures (e.g. a driver/library mismatch) raise :class:`CudaError`.
    """
    try:
        init()
    except CudaUnavailable:
        return 0
    n = ctypes.c_int(0)
    _call("cuDeviceGetCount", ctypes.byref(n))
    return n.value


def driver_version() -> int:
    """The driver's CUDA version as an int (13000 for 13.0). Needs no cuInit."""
    v = ctypes.c_int(0)
    _call("cuDriverGetVersion", ctypes.byref(v))
    return v.value


def _device(ordinal: int) -> int:
    init()
    d = ctypes.c_int(0)
    _call("cuDeviceGet", ctypes.byref(d), int(ordinal), detail=f"device ordinal {ordinal}")
    return d.value


def device_name(ordinal: int) -> str:
    buf = ctypes.create_string_buffer(256)
    _call("cuDeviceGetName", buf, len(buf), _device(ordinal))
    return buf.value.decode(errors="replace")


def device_attribute(attr: int, ordinal: int) -> int:
    v = ctypes.c_int(0)
    _call("cuDeviceGetAttribute", ctypes.byref(v), int(attr), _device(ordinal))
    return v.value


def total_memory(ordinal: int) -> int:
    v = ctypes.c_size_t(0)
    _call("cuDeviceTotalMem", ctypes.byref(v), _device(ordinal))
    return v.value


def pci_bus_id(ordinal: int) -> str:
    dom = device_attribute(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, ordinal)
    bus = device_attribute(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, ordinal)
    dev = device_attribute(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, ordinal)
    return f"{dom:08x}:{bus:02x}:{dev:02x}.0"


def can_access_peer(ordinal: int, peer_ordinal: int) -> bool:
    v = ctypes.c_int(0)
    _call("cuDeviceCanAccessPeer", ctypes.byref(v), _device(ordinal), _device(peer_ordinal))
    return bool(v.value)


def format_uuid(raw: bytes, prefix: str = "GPU-") -> str:
    """16 raw bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's spelling)."""
    h = bytes(raw).hex()
    if len(h) != 32:
        raise ValueError(f"a UUID has 16 bytes, got {len(raw)}")
    return f"{prefix}{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_UUID_RE = re.compile(r"^(?:(?:gpu|mig)-)?([0-9a-f]{8})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{12})$")


def normalize_uuid(text: str) -> str | None:
    """32 lowercase hex digits of a UUID string, or None when ``text`` is not one.

    Accepts nvidia-smi's ``GPU-...``/``MIG-...`` form and torch's bare
    ``xxxxxxxx-xxxx-...`` form (``str(torch.cuda.get_device_properties(i).uuid)``).
    """
    if not isinstance(text, str):
        return None
    m = _UUID_RE.match(text.strip().lower())
    return "".join(m.groups()) if m else None


def uuid_bytes(ordinal: int) -> bytes:
    u = CUuuid()
    _call("cuDeviceGetUuid", ctypes.byref(u), _device(ordinal))
    return bytes(u.bytes)


def uuid_of(ordinal: int) -> str:
    """UUID of a device ordinal, as nvidia-smi prints it (``GPU-...``)."""
    return format_uuid(uuid_bytes(ordinal))


def device_by_uuid(text: str) -> int:
    """Ordinal (in this process) of the device with UUID ``text``.

    Raises ValueError when ``text`` is not a UUID and LookupError when no
    visible device has it (both messages list the visible devices).
    """
    want = normalize_uuid(text)
    if want is None:
        raise ValueError(
            f"{text!r:.80} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, "
            f"as `nvidia-smi -L` prints); visible: {', '.join(visible_uuids()) or 'none'}"
        )
    n = device_count()
    for i in range(n):
        if uuid_bytes(i).hex() == want:
            return i
    raise LookupError(
        f"no visible GPU has UUID {text!r:.80} (check CUDA_VISIBLE_DEVICES of the daemon); "
        f"visible: {', '.join(visible_uuids()) or 'none'}"
    )


def parse_device(text: str) -> int:
    """A UUID (any accepted spelling) or a decimal ordinal string -> ordinal. For tools, not the protocol."""
    s = str(text).strip()
    if s.isdigit():
        i = int(s)
        n = device_count()
        if not 0 <= i < n:
            raise LookupError(f"device ordinal {i} out of range: {n} visible device(s)")
        return i
    return device_by_uuid(s)


def visible_uuids() -> list[str]:
    try:
        return [uuid_of(i) for i in range(device_count())]
    except Exception:
        return []


# ---------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------
_primary: dict[int, int] = {}  # ordinal -> primary CUcontext retained by this module
_ctx_info: dict[int, dict] = {}  # ordinal -> measurement of the latest creation by this module


def primary_context_active(ordinal: int) -> bool:
    """Whether the device's primary context exists in this process (creates nothing)."""
    flags = ctypes.c_uint(0)
    active = ctypes.c_int(0)
    _call("cuDevicePrimaryCtxGetState", _device(ordinal), ctypes.byref(flags), ctypes.byref(active))
    return bool(active.value)


def primary_context(ordinal: int) -> int:
    """Retain (once, until :func:`release_primary_context`) and return a device's primary context.

    The primary context is the one the CUDA runtime, and so torch, uses: a
    client's mappings made through it are usable by torch kernels. When this
    retain creates the context, the drop in the device's free memory is
    measured (through NVML, which needs no context) together with the time it
    took, and kept for :func:`context_overhead`.
    """
    ctx = _primary.get(ordinal)
    if ctx is not None:
        return ctx
    with _lock:
        ctx = _primary.get(ordinal)
        if ctx is not None:
            return ctx
        dev = _device(ordinal)
        was_active = primary_context_active(ordinal)
        uuid = uuid_of(ordinal)
        before = None if was_active else nvml_free_bytes(uuid)
        c = ctypes.c_void_p()
        t0 = time.perf_counter()
        _call("cuDevicePrimaryCtxRetain", ctypes.byref(c), dev, detail=f"device {ordinal} ({uuid})")
        seconds = time.perf_counter() - t0
        after = None if was_active else nvml_free_bytes(uuid)
        prev = _ctx_info.get(ordinal, {})
        if was_active:
            info = dict(prev) if prev else {"bytes": None, "note": "primary context already active in this process"}
        elif before is None or after is None:
            info = {"bytes": None, "note": "NVML unavailable", "seconds": seconds}
        else:
            info = {
                "bytes": max(0, before - after),
                "note": "free-memory drop (NVML) at primary context creation",
                "seconds": seconds,
            }
        info["creations"] = prev.get("creations", 0) + (0 if was_active else 1)
        _ctx_info[ordinal] = info
        _primary[ordinal] = c.value
        return c.value


def context_overhead(ordinal: int) -> dict | None:
    """``{bytes, seconds, note, creations}`` of the latest primary-context creation by this module, or None."""
    info = _ctx_info.get(ordinal)
    return dict(info) if info is not None else None


def release_primary_context(ordinal: int) -> bool:
    """Drop this module's retain of one device's primary context; True if one was held.

    When nothing else in the process retains it (the daemon: nothing does), the
    driver destroys the context and returns its memory. VMM allocations
    (cuMemCreate) and exported fds are not tied to a context and survive this;
    mappings made in the context must be gone first.
    """
    with _lock:
        if _primary.pop(ordinal, None) is None:
            return False
        _call("cuDevicePrimaryCtxRelease", _device(ordinal))
        return True


def release_primary_contexts() -> None:
    """Drop every retain this module holds (daemon shutdown)."""
    with _lock:
        for ordinal in list(_primary):
            release_primary_context(ordinal)


def current_context() -> int | None:
    c = ctypes.c_void_p()
    _call("cuCtxGetCurrent", ctypes.byref(c))
    return c.value


def set_current(ordinal: int) -> None:
    """Make the device's primary context current on the calling thread."""
    _call("cuCtxSetCurrent", ctypes.c_void_p(primary_context(ordinal)))


@contextlib.contextmanager
def on_device(ordinal: int):
    """Push the device's primary context for the block, then restore the thread's previous one."""
    ctx = primary_context(ordinal)
    _call("cuCtxPushCurrent", ctypes.c_void_p(ctx))
    try:
        yield ctx
    finally:
        popped = ctypes.c_void_p()
        _raw("cuCtxPopCurrent", ctypes.byref(popped))


def synchronize() -> None:
    _call("cuCtxSynchronize")


def mem_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current context's device (cuMemGetInfo)."""
    free = ctypes.c_size_t(0)
    total = ctypes.c_size_t(0)
    _call("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def device_mem_info(ordinal: int) -> tuple[int, int]:
    """``(free, total)`` of a device, through its primary context (which this retains)."""
    with on_device(ordinal):
        return mem_info()


# ---------------------------------------------------------------------------
# Virtual memory management
# ---------------------------------------------------------------------------
def _prop(ordinal: int, handle_types: int) -> CUmemAllocationProp:
    p = CUmemAllocationProp()
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED
    p.requestedHandleTypes = int(handle_types)
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = int(ordinal)
    return p


def granularity(
    ordinal: int, handle_types: int = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, recommended: bool = False
) -> int:
    """Allocation granularity of a device (minimum, or recommended)."""
    init()
    g = ctypes.c_size_t(0)
    p = _prop(ordinal, handle_types)
    flag = CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else CU_MEM_ALLOC_GRANULARITY_MINIMUM
    _call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(p), flag)
    return g.value


_fabric_failed: dict[int, CudaError] = {}  # ordinal -> why fabric allocation was refused


def fabric_refusal(ordinal: int) -> CudaError | None:
    """Why a fabric-handle allocation was refused on this device (None if never tried or it worked)."""
    return _fabric_failed.get(ordinal)


def create(size: int, ordinal: int, handle_types: int | None = None) -> tuple[int, int]:
    """``cuMemCreate`` of ``size`` pinned bytes on a device; returns ``(handle, handle_types)``.

    With ``handle_types=None``: try POSIX_FD|FABRIC first and, when the driver
    refuses (NOT_PERMITTED without an IMEX channel, NOT_SUPPORTED, INVALID_VALUE),
    fall back to POSIX_FD alone; a device that refused once is not asked again.
    The returned ``handle_types`` says which were granted. ``size`` must be a
    multiple of :func:`granularity`. No context is needed (driver 580 / CUDA 13
    on H200: create, export, import and release all work with none current).
    """
    init()
    if handle_types is None:
        if ordinal not in _fabric_failed:
            try:
                h = _create(size, ordinal, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)
                return h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC
            except CudaError as exc:
                if exc.result not in FABRIC_FALLBACK_RESULTS:
                    raise
                _fabric_failed[ordinal] = exc
        handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return _create(size, ordinal, handle_types), int(handle_types)


def _create(size: int, ordinal: int, handle_types: int) -> int:
    p = _prop(ordinal, handle_types)
    h = _c_u64(0)
    _call(
        "cuMemCreate",
        ctypes.byref(h),
        int(size),
        ctypes.byref(p),
        0,
        detail=f"{size} bytes on device {ordinal}, handle types {handle_types:#x}",
    )
    return h.value


def release(handle: int) -> None:
    _call("cuMemRelease", _c_u64(handle))


def export_fd(handle: int) -> int:
    """Export a POSIX file descriptor for an allocation (made close-on-exec here)."""
    fd = ctypes.c_int(-1)
    _call(
        "cuMemExportToShareableHandle",
        ctypes.byref(fd),
        _c_u64(handle),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        0,
    )
    try:
        flags = fcntl.fcntl(fd.value, fcntl.F_GETFD)
        fcntl.fcntl(fd.value, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
    except OSError:
        pass
    return fd.value


def export_fabric(handle: int) -> bytes:
    """Export the 64-byte fabric handle of an allocation created with the FABRIC type."""
    fh = CUmemFabricHandle()
    _call("cuMemExportToShareableHandle", ctypes.byref(fh), _c_u64(handle), CU_MEM_HANDLE_TYPE_FABRIC, 0)
    return bytes(fh.data)


def import_fd(fd: int) -> int:
    """Import an allocation from a POSIX fd (the caller keeps, and later closes, the fd).

    The fd is passed by value in the pointer argument, as the driver expects
    for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.
    """
    h = _c_u64(0)
    _call(
        "cuMemImportFromShareableHandle",
        ctypes.byref(h),
        ctypes.c_void_p(int(fd)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        detail=f"fd {fd}",
    )
    return h.value


def import_fabric(data: bytes) -> int:
    if len(data) != FABRIC_HANDLE_SIZE:
        raise ValueError(f"a fabric handle has {FABRIC_HANDLE_SIZE} bytes, got {len(data)}")
    fh = CUmemFabricHandle.from_buffer_copy(bytes(data))
    h = _c_u64(0)
    _call("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.byref(fh), CU_MEM_HANDLE_TYPE_FABRIC)
    return h.value


def reserve(size: int, align: int = 0, addr: int = 0) -> int:
    """Reserve a virtual address range; returns its start."""
    p = _c_u64(0)
    _call(
        "cuMemAddressReserve",
        ctypes.byref(p),
        int(size),
        int(align),
        _c_u64(addr),
        0,
        detail=f"{size} bytes, alignment {align}",
    )
    return p.value


def address_free(ptr: int, size: int) -> None:
    _call("cuMemAddressFree", _c_u64(ptr), int(size))


def map(ptr: int, size: int, handle: int, offset: int = 0) -> None:  # noqa: A001 (driver name)
    _call("cuMemMap", _c_u64(ptr), int(size), int(offset), _c_u64(handle), 0, detail=f"{size} bytes at {ptr:#x}")


def unmap(ptr: int, size: int) -> None:
    _call("cuMemUnmap", _c_u64(ptr), int(size))


def set_access(ptr: int, size: int, devices, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> None:
    """Grant ``devices`` (an ordinal or a list of them) access to a mapped range."""
    if isinstance(devices, int):
        devices = [devices]
    devices = list(devices)
    arr = (CUmemAccessDesc * len(devices))()
    for i, d in enumerate(devices):
        arr[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE
        arr[i].location.id = int(d)
        arr[i].flags = int(flags)
    _call(
        "cuMemSetAccess",
        _c_u64(ptr),
        int(size),
        arr,
        len(devices),
        detail=f"{size} bytes at {ptr:#x} for device(s) {devices}",
    )


def memset_d8(ptr: int, value: int, count: int) -> None:
    """Synchronous with respect to the host only after :func:`synchronize`."""
    _call("cuMemsetD8", _c_u64(ptr), ctypes.c_ubyte(value & 0xFF), int(count))


def memcpy_htod(dst: int, data, count: int | None = None) -> None:
    """Copy ``data`` (bytes, bytearray or any buffer) to device address ``dst``."""
    buf = (ctypes.c_char * len(data)).from_buffer_copy(data) if not isinstance(data, ctypes.Array) else data
    n = len(data) if count is None else int(count)
    if n > ctypes.sizeof(buf):
        raise ValueError(f"copy of {n} bytes from a buffer of {ctypes.sizeof(buf)}")
    _call("cuMemcpyHtoD", _c_u64(dst), ctypes.cast(buf, ctypes.c_void_p), n)


def memcpy_dtoh(src: int, count: int) -> bytes:
    buf = ctypes.create_string_buffer(int(count))
    _call("cuMemcpyDtoH", ctypes.cast(buf, ctypes.c_void_p), _c_u64(src), int(count))
    return buf.raw


def pointer_device_ordinal(ptr: int) -> int:
    v = ctypes.c_int(-1)
    _call("cuPointerGetAttribute", ctypes.byref(v), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, _c_u64(ptr))
    return v.value


# ---------------------------------------------------------------------------
# Host memory registration (control block)
# ---------------------------------------------------------------------------
def host_register(ptr: int, size: int, flags: int = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP) -> None:
    _call("cuMemHostRegister", ctypes.c_void_p(ptr), int(size), int(flags), detail=f"{size} bytes at {ptr:#x}")


def host_unregister(ptr: int) -> None:
    _call("cuMemHostUnregister", ctypes.c_void_p(ptr))


def host_device_pointer(ptr: int) -> int:
    d = _c_u64(0)
    _call("cuMemHostGetDevicePointer", ctypes.byref(d), ctypes.c_void_p(ptr), 0)
    return d.value


# ---------------------------------------------------------------------------
# NVML (free memory without a CUDA context, for overhead measurement)
# ---------------------------------------------------------------------------
class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


_nvml: ctypes.CDLL | None = None
_nvml_failed = False


def _nvml_lib() -> ctypes.CDLL | None:
    global _nvml, _nvml_failed
    if _nvml is not None or _nvml_failed:
        return _nvml
    with _lock:
        if _nvml is not None or _nvml_failed:
            return _nvml
        try:
            lib = ctypes.CDLL(os.environ.get("A2AD_LIBNVML", "libnvidia-ml.so.1"))
            lib.nvmlInit_v2.restype = ctypes.c_int
            lib.nvmlInit_v2.argtypes = []
            lib.nvmlDeviceGetHandleByUUID.restype = ctypes.c_int
            lib.nvmlDeviceGetHandleByUUID.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
            lib.nvmlDeviceGetMemoryInfo.restype = ctypes.c_int
            lib.nvmlDeviceGetMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(_NvmlMemory)]
            if lib.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
        except (OSError, AttributeError):
            _nvml_failed = True
            return None
        _nvml = lib
        return lib


def nvml_free_bytes(uuid: str) -> int | None:
    """Free memory of the GPU with this UUID as NVML reports it, or None without NVML.

    NVML sees every GPU of the node regardless of CUDA_VISIBLE_DEVICES, and needs
    no CUDA context, so this can be read before a context exists.
    """
    lib = _nvml_lib()
    if lib is None:
        return None
    h = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(h)) != 0:
        return None
    m = _NvmlMemory()
    if lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) != 0:
        return None
    return int(m.free)
