"""The CUDA driver API for a2ad, through NVIDIA's cuda-bindings (``cuda.bindings.driver``).

The daemon uses this instead of torch so that it never creates a torch CUDA
context; clients use it next to torch (both share the device's primary
context). Only what a2ad needs is here: device discovery, primary contexts,
the virtual-memory-management (VMM) calls (``cuMemCreate``, export/import of
shareable handles, ``cuMemAddressReserve``/``cuMemMap``/``cuMemSetAccess``),
a synchronous memset/memcpy for initialization, and ``cuMemGetInfo``.

cuda-bindings is the optional extra ``a2ad[cuda]``. Nothing is imported or
loaded at import time: ``cuda.bindings`` is imported, the driver library
loaded and ``cuInit`` called on first use, so importing this module on a
machine without cuda-bindings or without a driver is always safe (the host
backend never gets that far). :func:`device_count` answers 0 there;
everything else raises :class:`CudaUnavailable` (a
:class:`~a2ad.errors.BackendError`) saying what is missing. Every driver call
goes through :func:`_call`, which turns a CUresult other than CUDA_SUCCESS
into :class:`CudaError` (function, result code, ``cuGetErrorName`` and
``cuGetErrorString``).

Allocation handles, device pointers and file descriptors cross this module's
boundary as plain ints; the ``CU_*`` constants below are plain ints with
``cuda.h``'s values, usable without cuda-bindings installed.

``A2AD_LIBCUDA`` names a driver library to load before cuda-bindings looks for
``libcuda.so.1`` (a path that does not load makes CUDA unavailable, which is
how the tests act out a machine without a driver).

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
import warnings

from . import errors

# ---------------------------------------------------------------------------
# Constants (values from cuda.h)
# ---------------------------------------------------------------------------
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801

#: Names of the results above, for when neither the driver (cuGetErrorName) nor
#: cuda-bindings (the CUresult enum) is there to name one.
_RESULT_NAMES = {v: k for k, v in list(globals().items()) if k.startswith("CUDA_")}

# CUmemAllocationHandleType (cuMemCreate takes a bitmask of them)
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8
# CUmemAccess_flags
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
# CUdevice_attribute (the few used here)
CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128

#: Size of a CUmemFabricHandle (CU_IPC_HANDLE_SIZE).
FABRIC_HANDLE_SIZE = 64

#: cuMemCreate results after which an allocation that asked for a fabric handle
#: is retried with the POSIX-fd handle type alone.
FABRIC_FALLBACK_RESULTS = frozenset({CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE})

INSTALL_HINT = ("pip install cuda-bindings (a2ad's cuda extra: pip install '.[cuda]' in a clone of a2ad, or "
                "'a2ad-<version>-py3-none-any.whl[cuda]')")


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
    """There is no usable CUDA here: cuda-bindings missing, no driver library, a stub library, no device.

    ``function`` says which step failed: ``cuda.bindings`` (the package does not
    import), ``libcuda`` (the driver library does not load) or the driver call.
    """

    def __init__(self, detail: str, result: int | None = None, function: str = "libcuda"):
        super().__init__(function, result, detail)
        self.detail = detail
        why = f" ({function}: {self.result_name})" if result is not None else ""
        self.message = f"CUDA is unavailable{why}: {detail}"
        self.args = (self.message,)


# ---------------------------------------------------------------------------
# Loading cuda-bindings and the driver, and calling it
# ---------------------------------------------------------------------------
_lock = threading.RLock()
_bindings = None  # the cuda.bindings.driver module, once imported
_bindings_failure: str | None = None  # why it did not import, answered again
_drv = None  # the same module, once the driver library loaded through it
_load_failure: tuple[str, str] | None = None  # (detail, function) of the failed load, answered again
_initialized = False
_init_result: int | None = None


def _module():
    """``cuda.bindings.driver``, imported on first use (its structs and enums need no driver)."""
    global _bindings, _bindings_failure
    if _bindings is not None:
        return _bindings
    with _lock:
        if _bindings is not None:
            return _bindings
        if _bindings_failure is None:
            try:
                from cuda.bindings import driver
            except ImportError as exc:
                _bindings_failure = f"the cuda-bindings package is not installed ({exc}); {INSTALL_HINT}"
            except Exception as exc:
                _bindings_failure = (
                    f"cuda.bindings could not be imported ({type(exc).__name__}: {exc}); reinstall it: {INSTALL_HINT}"
                )
            else:
                _bindings = driver
                return driver
        raise CudaUnavailable(_bindings_failure, function="cuda.bindings")


def _api():
    """``cuda.bindings.driver`` with the driver library loaded; CudaUnavailable when either is missing."""
    global _drv, _load_failure
    if _drv is not None:
        return _drv
    with _lock:
        if _drv is not None:
            return _drv
        if _load_failure is None:
            try:
                _drv = _load()
                return _drv
            except CudaUnavailable as exc:
                _load_failure = (exc.detail, exc.function)
        detail, function = _load_failure
        raise CudaUnavailable(detail, function=function)


def _load():
    override = os.environ.get("A2AD_LIBCUDA")
    if override:
        try:
            ctypes.CDLL(override, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise CudaUnavailable(
                f"the CUDA driver library {override} (A2AD_LIBCUDA) could not be loaded ({exc}); "
                "is the NVIDIA driver installed?"
            ) from None
    driver = _module()
    # The first call makes cuda-bindings open libcuda.so.1; cuDriverGetVersion needs no cuInit.
    try:
        driver.cuDriverGetVersion()
    except Exception as exc:  # RuntimeError / cuda.pathfinder's DynamicLibNotFoundError: no driver library
        raise CudaUnavailable(
            f"the CUDA driver library libcuda.so.1 could not be loaded through cuda-bindings ({exc}); "
            "is the NVIDIA driver installed?"
        ) from None
    return driver


def _invoke(name: str, *args) -> tuple:
    """Call ``driver.<name>(*args)``; returns cuda-bindings' ``(CUresult, *outputs)`` unchecked."""
    fn = getattr(_api(), name, None)
    if fn is None:
        raise CudaUnavailable(f"the installed cuda-bindings has no {name}; {INSTALL_HINT}", function=name)
    try:
        return fn(*args)
    except RuntimeError as exc:
        if "not found" not in str(exc):
            raise
        # cuda-bindings found no such entry point in the loaded driver library
        raise CudaUnavailable(f"{exc} (is the driver older than cuda-bindings?)", function=name) from None


def _call(name: str, *args, detail: str = ""):
    """Call a driver function; raise CudaError unless it returns CUDA_SUCCESS.

    Returns its outputs: None when there are none, the output when there is
    one, a tuple otherwise.
    """
    out = _invoke(name, *args)
    r = int(out[0])
    if r != CUDA_SUCCESS:
        raise CudaError(name, r, detail)
    if len(out) == 1:
        return None
    return out[1] if len(out) == 2 else tuple(out[1:])


def _error_string(result: int) -> str:
    drv = _drv
    if drv is None:
        return ""
    try:
        r, s = drv.cuGetErrorString(drv.CUresult(result))
        if int(r) == CUDA_SUCCESS and s:
            return s.decode(errors="replace")
    except Exception:
        pass
    return ""


def error_name(result: int) -> str:
    """``CUDA_ERROR_...`` name of a CUresult (cuGetErrorName, cuda-bindings' enum, or a built-in table)."""
    drv = _drv
    if drv is not None:
        try:
            r, s = drv.cuGetErrorName(drv.CUresult(result))
            if int(r) == CUDA_SUCCESS and s:
                return s.decode(errors="replace")
        except Exception:
            pass
    if _bindings is not None:
        try:
            return _bindings.CUresult(result).name
        except Exception:
            pass
    return _RESULT_NAMES.get(result, f"CUresult {result}")


def bindings_version() -> str | None:
    """Version of the installed cuda-bindings (None when it is not installed). Imports nothing else."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cuda-bindings")
    except PackageNotFoundError:
        return None


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
        r = int(_invoke("cuInit", 0)[0])
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


def unavailable() -> CudaError | None:
    """Why this process cannot use CUDA (the error that says so), or None when it can.

    It can when cuda-bindings imports, the driver loads and initializes, and at
    least one device is visible.
    """
    try:
        init()
        n = _call("cuDeviceGetCount")
    except CudaError as exc:  # CudaUnavailable included
        return exc
    if n <= 0:
        return CudaUnavailable("the CUDA driver reports no device", function="cuDeviceGetCount")
    return None


def available() -> bool:
    """True when cuda-bindings imports and the driver loads, initializes and reports at least one device."""
    try:
        return unavailable() is None
    except Exception:
        return False


def device_count() -> int:
    """Number of visible devices; 0 without cuda-bindings, without a driver library or without a device.

    Other driver failures (e.g. a driver/library mismatch) raise :class:`CudaError`.
    """
    try:
        init()
    except CudaUnavailable:
        return 0
    return int(_call("cuDeviceGetCount"))


def driver_version() -> int:
    """The driver's CUDA version as an int (13000 for 13.0). Needs no cuInit."""
    return int(_call("cuDriverGetVersion"))


def _device(ordinal: int):
    init()
    return _call("cuDeviceGet", int(ordinal), detail=f"device ordinal {ordinal}")


def device_name(ordinal: int) -> str:
    raw = _call("cuDeviceGetName", 256, _device(ordinal))
    return bytes(raw).split(b"\0", 1)[0].rstrip().decode(errors="replace")


def device_attribute(attr: int, ordinal: int) -> int:
    dev = _device(ordinal)
    return int(_call("cuDeviceGetAttribute", _module().CUdevice_attribute(int(attr)), dev))


def total_memory(ordinal: int) -> int:
    return int(_call("cuDeviceTotalMem", _device(ordinal)))


def pci_bus_id(ordinal: int) -> str:
    dom = device_attribute(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, ordinal)
    bus = device_attribute(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, ordinal)
    dev = device_attribute(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, ordinal)
    return f"{dom:08x}:{bus:02x}:{dev:02x}.0"


def can_access_peer(ordinal: int, peer_ordinal: int) -> bool:
    return bool(_call("cuDeviceCanAccessPeer", _device(ordinal), _device(peer_ordinal)))


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


def _uuid_bytes(ordinal: int) -> bytes:
    dev = _device(ordinal)
    # CUDA 12's cuDeviceGetUuid_v2 (MIG-aware) is CUDA 13's cuDeviceGetUuid; cuda-bindings 13 has only the latter.
    name = "cuDeviceGetUuid_v2" if hasattr(_api(), "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
    return bytes(_call(name, dev).bytes)


def uuid_of(ordinal: int) -> str:
    """UUID of a device ordinal, as nvidia-smi prints it (``GPU-...``)."""
    return format_uuid(_uuid_bytes(ordinal))


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
        if _uuid_bytes(i).hex() == want:
            return i
    raise LookupError(
        f"no visible GPU has UUID {text!r:.80} (check CUDA_VISIBLE_DEVICES of the daemon); "
        f"visible: {', '.join(visible_uuids()) or 'none'}"
    )


def visible_uuids() -> list[str]:
    try:
        return [uuid_of(i) for i in range(device_count())]
    except Exception:
        return []


# ---------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------
_primary: dict[int, object] = {}  # ordinal -> primary CUcontext retained by this module
_ctx_info: dict[int, dict] = {}  # ordinal -> measurement of the latest creation by this module


def primary_context_active(ordinal: int) -> bool:
    """Whether the device's primary context exists in this process (creates nothing)."""
    _flags, active = _call("cuDevicePrimaryCtxGetState", _device(ordinal))
    return bool(active)


def primary_context(ordinal: int):
    """Retain (once, until :func:`release_primary_context`) and return a device's primary context (a CUcontext).

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
        t0 = time.perf_counter()
        ctx = _call("cuDevicePrimaryCtxRetain", dev, detail=f"device {ordinal} ({uuid})")
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
        _primary[ordinal] = ctx
        return ctx


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


@contextlib.contextmanager
def on_device(ordinal: int):
    """Push the device's primary context for the block, then restore the thread's previous one."""
    ctx = primary_context(ordinal)
    _call("cuCtxPushCurrent", ctx)
    try:
        yield ctx
    finally:
        _invoke("cuCtxPopCurrent")


def synchronize() -> None:
    _call("cuCtxSynchronize")


def mem_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current context's device (cuMemGetInfo)."""
    free, total = _call("cuMemGetInfo")
    return int(free), int(total)


# ---------------------------------------------------------------------------
# Virtual memory management
# ---------------------------------------------------------------------------
class _HandleTypeMask(int):
    """Several CUmemAllocationHandleType bits at once, for ``CUmemAllocationProp.requestedHandleTypes``.

    cuda.h declares that field a bitmask of handle types; cuda-bindings types
    it as the enum, which has no member for a combination, and its setter
    stores the argument's ``.value``. This int carries the combined bits there.
    """

    @property
    def value(self) -> int:
        return int(self)


def _prop(ordinal: int, handle_types: int):
    drv = _module()
    p = drv.CUmemAllocationProp()
    p.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = int(ordinal)
    types = int(handle_types)
    try:
        p.requestedHandleTypes = drv.CUmemAllocationHandleType(types)
    except ValueError:  # a combination, e.g. POSIX_FILE_DESCRIPTOR | FABRIC
        p.requestedHandleTypes = _HandleTypeMask(types)
    return p


def granularity(
    ordinal: int, handle_types: int = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, recommended: bool = False
) -> int:
    """Allocation granularity of a device (minimum, or recommended)."""
    init()
    flags = _module().CUmemAllocationGranularity_flags
    flag = flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(
        _call(
            "cuMemGetAllocationGranularity",
            _prop(ordinal, handle_types),
            flag,
            detail=f"device {ordinal}, handle types {int(handle_types):#x}",
        )
    )


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
    h = _call(
        "cuMemCreate",
        int(size),
        _prop(ordinal, handle_types),
        0,
        detail=f"{size} bytes on device {ordinal}, handle types {int(handle_types):#x}",
    )
    return int(h)


def release(handle: int) -> None:
    _call("cuMemRelease", int(handle))


def _handle_type(value: int):
    return _module().CUmemAllocationHandleType(value)


def export_fd(handle: int) -> int:
    """Export a POSIX file descriptor for an allocation (made close-on-exec here)."""
    fd = int(
        _call("cuMemExportToShareableHandle", int(handle), _handle_type(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), 0)
    )
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
    except OSError:
        pass
    return fd


def export_fabric(handle: int) -> bytes:
    """Export the 64-byte fabric handle of an allocation created with the FABRIC type."""
    fh = _call("cuMemExportToShareableHandle", int(handle), _handle_type(CU_MEM_HANDLE_TYPE_FABRIC), 0)
    return bytes(fh.data)


def import_fd(fd: int) -> int:
    """Import an allocation from a POSIX fd (the caller keeps, and later closes, the fd).

    The fd goes by value in the pointer argument, as the driver expects for
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (cuda-bindings passes an int
    through as that pointer).
    """
    h = _call(
        "cuMemImportFromShareableHandle",
        int(fd),
        _handle_type(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        detail=f"fd {fd}",
    )
    return int(h)


def import_fabric(data: bytes) -> int:
    if len(data) != FABRIC_HANDLE_SIZE:
        raise ValueError(f"a fabric handle has {FABRIC_HANDLE_SIZE} bytes, got {len(data)}")
    # the handle's bytes go by address: cuda-bindings passes a buffer's address as the pointer
    h = _call("cuMemImportFromShareableHandle", bytearray(data), _handle_type(CU_MEM_HANDLE_TYPE_FABRIC))
    return int(h)


def reserve(size: int, align: int = 0, addr: int = 0) -> int:
    """Reserve a virtual address range; returns its start."""
    p = _call("cuMemAddressReserve", int(size), int(align), int(addr), 0, detail=f"{size} bytes, alignment {align}")
    return int(p)


def address_free(ptr: int, size: int) -> None:
    _call("cuMemAddressFree", int(ptr), int(size))


def map(ptr: int, size: int, handle: int, offset: int = 0) -> None:  # noqa: A001 (driver name)
    _call("cuMemMap", int(ptr), int(size), int(offset), int(handle), 0, detail=f"{size} bytes at {ptr:#x}")


def unmap(ptr: int, size: int) -> None:
    _call("cuMemUnmap", int(ptr), int(size))


def set_access(ptr: int, size: int, devices, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> None:
    """Grant ``devices`` (an ordinal or a list of them) access to a mapped range."""
    if isinstance(devices, int):
        devices = [devices]
    devices = [int(d) for d in devices]
    drv = _module()
    descs = []
    for d in devices:
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = d
        desc.flags = drv.CUmemAccess_flags(int(flags))
        descs.append(desc)
    _call(
        "cuMemSetAccess",
        int(ptr),
        int(size),
        descs,
        len(descs),
        detail=f"{size} bytes at {ptr:#x} for device(s) {devices}",
    )


def memset_d8(ptr: int, value: int, count: int) -> None:
    """Synchronous with respect to the host only after :func:`synchronize`."""
    _call("cuMemsetD8", int(ptr), int(value) & 0xFF, int(count))


def memcpy_htod(dst: int, data, count: int | None = None) -> None:
    """Copy ``data`` (bytes, bytearray or any contiguous buffer) to device address ``dst``."""
    view = memoryview(data).cast("B")
    n = view.nbytes if count is None else int(count)
    if n > view.nbytes:
        raise ValueError(f"copy of {n} bytes from a buffer of {view.nbytes}")
    _call("cuMemcpyHtoD", int(dst), view, n)


def memcpy_dtoh(src: int, count: int) -> bytes:
    buf = bytearray(int(count))
    _call("cuMemcpyDtoH", buf, int(src), int(count))
    return bytes(buf)


def pointer_device_ordinal(ptr: int) -> int:
    attr = _module().CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(_call("cuPointerGetAttribute", attr, int(ptr)))


# ---------------------------------------------------------------------------
# NVML (free memory without a CUDA context, for overhead measurement)
# ---------------------------------------------------------------------------
_nvml = None  # ("pynvml", module) or ("ctypes", CDLL) once NVML initialized
_nvml_failed = False


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_backend():
    """NVML through nvidia-ml-py (``pynvml``) when installed, else a minimal ctypes binding; None without NVML."""
    global _nvml, _nvml_failed
    if _nvml is not None or _nvml_failed:
        return _nvml
    with _lock:
        if _nvml is not None or _nvml_failed:
            return _nvml
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the old "pynvml" distribution warns that it is deprecated
                import pynvml
            pynvml.nvmlInit()
            _nvml = ("pynvml", pynvml)
            return _nvml
        except Exception:
            pass
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
        _nvml = ("ctypes", lib)
        return _nvml


def nvml_free_bytes(uuid: str) -> int | None:
    """Free memory of the GPU with this UUID as NVML reports it, or None without NVML.

    NVML sees every GPU of the node regardless of CUDA_VISIBLE_DEVICES, and needs
    no CUDA context, so this can be read before a context exists.
    """
    backend = _nvml_backend()
    if backend is None:
        return None
    kind, nv = backend
    if kind == "pynvml":
        try:
            try:
                h = nv.nvmlDeviceGetHandleByUUID(uuid)
            except (TypeError, ctypes.ArgumentError):  # older nvidia-ml-py wants bytes
                h = nv.nvmlDeviceGetHandleByUUID(uuid.encode())
            return int(nv.nvmlDeviceGetMemoryInfo(h).free)
        except Exception:
            return None
    h = ctypes.c_void_p()
    if nv.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(h)) != 0:
        return None
    m = _NvmlMemory()
    if nv.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) != 0:
        return None
    return int(m.free)
