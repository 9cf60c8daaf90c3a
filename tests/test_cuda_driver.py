"""a2ad.cuda_driver, the driver API through NVIDIA's cuda-bindings.

CPU tests (always run; cuda-bindings need not be installed): the module and the
daemon import neither cuda.bindings nor torch until CUDA is probed; without
cuda-bindings, or without a loadable driver library, every entry point fails
with CudaUnavailable saying what to install or what is missing, device_count()
is 0 and the backend probe answers False. With cuda-bindings installed (still no
GPU needed): the module's constants are cuda.h's (as cuda-bindings spells them),
every driver function the module calls exists and takes the arguments it is
given, and a combined handle-type request reaches the C struct as a bitmask.

GPU test (``gpu`` marker): a 2 MiB allocation exported as a POSIX fd and
imported again, both mapped side by side; a memset and a host copy through one
mapping read back through the other; the automatic fabric/POSIX-fd choice; the
error a bad fd gives; everything released. No torch.
"""

from __future__ import annotations

import ast
import ctypes
import fcntl
import inspect
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from a2ad import cuda_driver as cd
from a2ad import errors

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20

#: Prepended to a child's code: cuda.bindings cannot be imported there.
NO_BINDINGS = 'import sys; sys.modules["cuda"] = None; sys.modules["cuda.bindings"] = None\n'


def _run_py(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _bindings():
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


needs_bindings = pytest.mark.skipif(_bindings() is None, reason="cuda-bindings is not installed")


# ===========================================================================
# CPU tests
# ===========================================================================
def test_without_cuda_bindings_everything_says_what_to_install():
    p = _run_py(
        NO_BINDINGS
        + textwrap.dedent(
            """
            from a2ad import cuda_driver as cd, errors
            from a2ad.daemon.backends import cuda_available, cuda_unavailable_reason, make_backend
            assert cd.device_count() == 0
            assert cd.available() is False and cuda_available() is False
            why = cd.unavailable()
            assert isinstance(why, cd.CudaUnavailable) and why.function == "cuda.bindings", why
            for call in (lambda: cd.uuid_of(0), cd.driver_version, lambda: cd.granularity(0),
                         lambda: cd.create(2 << 20, 0), lambda: cd.import_fd(0)):
                try:
                    call()
                except cd.CudaUnavailable as exc:
                    assert isinstance(exc, errors.BackendError)
                    assert "pip install cuda-bindings" in exc.message, exc.message
                    assert "pip install cuda-bindings" in exc.message and "[cuda]" in exc.message, exc.message
                else:
                    raise AssertionError("no CudaUnavailable")
            assert "cuda-bindings" in cuda_unavailable_reason()
            try:
                make_backend("cuda")
            except errors.BackendError as exc:
                s = str(exc)
                assert "pip install cuda-bindings" in s and "GPU" in s and "host" in s, s
            else:
                raise AssertionError("make_backend('cuda') did not raise")
            assert make_backend("auto").name == "host"
            # errors still carry a name without the bindings (a built-in table)
            e = cd.CudaError("cuMemCreate", cd.CUDA_ERROR_OUT_OF_MEMORY, "4096 bytes on device 0")
            assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in e.message and "4096 bytes" in e.message, e.message
            print("ok")
            """
        )
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_imports_are_lazy_and_torch_free():
    """Importing the driver module, the backends and the server loads neither cuda.bindings nor
    torch; probing CUDA may load cuda.bindings, never torch."""
    p = _run_py(
        """
        import importlib.util, sys
        import a2ad.cuda_driver, a2ad.daemon.backends, a2ad.daemon.backends.cuda
        if importlib.util.find_spec("zmq") is not None:  # the server needs pyzmq
            import a2ad.daemon.server
        from a2ad.daemon.backends import make_backend, cuda_available
        make_backend("host").close()
        assert "cuda.bindings" not in sys.modules and "cuda" not in sys.modules, sorted(sys.modules)
        cuda_available()
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_driver_library_that_does_not_load_is_clean():
    """A2AD_LIBCUDA naming a missing library: no CUDA, said clearly, with or without cuda-bindings."""
    p = _run_py(
        """
        from a2ad import cuda_driver as cd
        from a2ad.daemon.backends import cuda_available, make_backend
        assert cd.device_count() == 0 and not cuda_available()
        why = cd.unavailable()
        assert isinstance(why, cd.CudaUnavailable) and why.function == "libcuda", why
        assert "/nonexistent/libcuda.so.1" in why.message and "NVIDIA driver" in why.message, why.message
        try:
            cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0)
        except cd.CudaUnavailable as exc:
            assert exc.message == why.message
        else:
            raise AssertionError("no CudaUnavailable")
        assert make_backend("auto").name == "host"
        print("ok")
        """,
        A2AD_LIBCUDA="/nonexistent/libcuda.so.1",
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_cuda_error_names_function_result_and_detail():
    exc = cd.CudaError("cuMemMap", cd.CUDA_ERROR_INVALID_VALUE, "2097152 bytes at 0x7f0000000000")
    assert isinstance(exc, errors.BackendError)
    assert exc.message.startswith("cuMemMap failed: CUDA_ERROR_INVALID_VALUE (1)"), exc.message
    assert exc.message.endswith(": 2097152 bytes at 0x7f0000000000"), exc.message
    assert exc.function == "cuMemMap" and exc.result == 1 and exc.result_name == "CUDA_ERROR_INVALID_VALUE"
    assert exc.details == {"function": "cuMemMap", "cuda_result": 1, "cuda_error": "CUDA_ERROR_INVALID_VALUE"}
    assert cd.error_name(cd.CUDA_ERROR_NOT_PERMITTED) == "CUDA_ERROR_NOT_PERMITTED"
    assert cd.error_name(123456) == "CUresult 123456"


# ===========================================================================
# With cuda-bindings installed (no GPU needed)
# ===========================================================================
@needs_bindings
def test_without_a_driver_the_bindings_path_is_clean():
    """cuda-bindings present: either a GPU is usable, or the failure is a CudaUnavailable naming the driver."""
    p = _run_py(
        """
        from a2ad import cuda_driver as cd
        why = cd.unavailable()
        if why is None:
            print("usable")
        else:
            assert isinstance(why, cd.CudaUnavailable), repr(why)
            assert cd.device_count() == 0
            try:
                cd.uuid_of(0)
            except cd.CudaUnavailable as exc:
                assert exc.message == why.message
            print(why.function, "|", why.message)
        """
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout.strip()
    if out == "usable":
        pytest.skip("this machine has a usable CUDA driver")
    function, message = out.split(" | ", 1)
    assert function in ("libcuda", "cuInit"), out
    if function == "libcuda":
        assert "libcuda.so.1" in message and "NVIDIA driver" in message, message


@needs_bindings
def test_constants_are_cuda_h_values():
    d = _bindings()
    pairs = {
        "CUDA_SUCCESS": d.CUresult,
        "CUDA_ERROR_INVALID_VALUE": d.CUresult,
        "CUDA_ERROR_OUT_OF_MEMORY": d.CUresult,
        "CUDA_ERROR_NOT_INITIALIZED": d.CUresult,
        "CUDA_ERROR_STUB_LIBRARY": d.CUresult,
        "CUDA_ERROR_NO_DEVICE": d.CUresult,
        "CUDA_ERROR_INVALID_CONTEXT": d.CUresult,
        "CUDA_ERROR_NOT_PERMITTED": d.CUresult,
        "CUDA_ERROR_NOT_SUPPORTED": d.CUresult,
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR": d.CUmemAllocationHandleType,
        "CU_MEM_HANDLE_TYPE_FABRIC": d.CUmemAllocationHandleType,
        "CU_MEM_ACCESS_FLAGS_PROT_READWRITE": d.CUmemAccess_flags,
    }
    pairs.update({name: d.CUdevice_attribute for name in dir(cd) if name.startswith("CU_DEVICE_ATTRIBUTE_")})
    for name, enum in pairs.items():
        assert getattr(cd, name) == int(getattr(enum, name)), name
    for code, name in cd._RESULT_NAMES.items():
        assert d.CUresult(code).name == name, (code, name)
    assert len(d.CUmemFabricHandle().data) == cd.FABRIC_HANDLE_SIZE


def _driver_calls() -> dict[str, set[int]]:
    """Every ``_call("cu...", ...)`` / ``_invoke("cu...", ...)`` in cuda_driver.py: name -> positional arg counts."""
    tree = ast.parse(Path(cd.__file__).read_text())
    calls: dict[str, set[int]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("_call", "_invoke")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            calls.setdefault(node.args[0].value, set()).add(len(node.args) - 1)
    # the UUID call picks its name at run time
    calls["cuDeviceGetUuid"] = {1}
    return calls


def _parameter_count(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # fall back on the embedded signature line
        m = re.match(rf"{fn.__name__}\((.*?)\)", (fn.__doc__ or "").strip())
        assert m, fn.__doc__
        return len([a for a in m.group(1).split(",") if a.strip()])


@needs_bindings
def test_every_driver_call_exists_with_the_arguments_given():
    d = _bindings()
    calls = _driver_calls()
    assert {"cuMemCreate", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemAddressReserve",
            "cuMemMap", "cuMemSetAccess", "cuMemGetAllocationGranularity", "cuDevicePrimaryCtxRetain"} <= set(calls)
    for name, arg_counts in sorted(calls.items()):
        fn = getattr(d, name, None)
        assert fn is not None, f"cuda.bindings.driver has no {name}"
        assert arg_counts == {_parameter_count(fn)}, (name, arg_counts, fn.__doc__.splitlines()[0])
    for name in ("cuGetErrorName", "cuGetErrorString", "cuDriverGetVersion"):  # called directly
        assert callable(getattr(d, name))


@needs_bindings
def test_allocation_properties_reach_the_c_struct():
    """CUmemAllocationProp as cuMemCreate sees it: type, requestedHandleTypes (a bitmask), location."""
    posix, fabric = cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, cd.CU_MEM_HANDLE_TYPE_FABRIC
    for types in (posix, fabric, posix | fabric):
        p = cd._prop(3, types)
        # cuda.h: { CUmemAllocationType type; CUmemAllocationHandleType requestedHandleTypes;
        #           CUmemLocation { CUmemLocationType type; int id; } location; ... }
        assert struct.unpack("<iiii", ctypes.string_at(p.getPtr(), 16)) == (1, types, 1, 3), types
    d = _bindings()
    desc = d.CUmemAccessDesc()
    desc.flags = d.CUmemAccess_flags(cd.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    assert int(desc.flags) == 3


# ===========================================================================
# GPU
# ===========================================================================
@pytest.mark.gpu
def test_export_import_map_copy_release_round_trip():
    if _bindings() is None:
        pytest.skip("cuda-bindings is not installed (pip install cuda-bindings, or the cuda extra: pip install '.[cuda]')")
    assert cd.unavailable() is None, cd.unavailable()
    ordinal = 0
    assert cd.driver_version() >= 12000
    uuid = cd.uuid_of(ordinal)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid), uuid
    assert cd.device_by_uuid(uuid) == ordinal
    name = cd.device_name(ordinal)
    assert name and "\0" not in name and name == name.strip(), repr(name)
    assert cd.total_memory(ordinal) > 0
    assert cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, ordinal) == 1
    assert cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, ordinal) == 1

    gran = cd.granularity(ordinal)
    assert gran > 0 and cd.granularity(ordinal, recommended=True) % gran == 0
    size = -(-2 * MiB // gran) * gran
    posix = cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    handle, types = cd.create(size, ordinal, posix)
    assert types == posix
    fd = cd.export_fd(handle)
    assert fd >= 0 and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    imported = cd.import_fd(fd)
    os.close(fd)  # the imported handle keeps the memory

    with cd.on_device(ordinal):
        assert cd.primary_context_active(ordinal)
        base = cd.reserve(2 * size, gran)
        try:
            cd.map(base, size, handle)  # the exporter's handle ...
            cd.map(base + size, size, imported)  # ... and the importer's, side by side
            try:
                cd.set_access(base, 2 * size, [ordinal])
                if cd.device_count() > 1:  # several access descriptors at once
                    cd.set_access(base, 2 * size, [ordinal, 1])
                cd.memset_d8(base, 0xAB, size)
                pattern = bytes((i * 7 + 3) & 0xFF for i in range(4096))
                cd.memcpy_htod(base + 4096, pattern)
                cd.synchronize()
                got = cd.memcpy_dtoh(base + size, size)  # read through the imported mapping
                assert got[:4096] == b"\xab" * 4096
                assert got[4096:8192] == pattern
                assert got[8192:] == b"\xab" * (size - 8192)
                assert cd.memcpy_dtoh(base + 4096, 16) == pattern[:16]
                assert cd.pointer_device_ordinal(base + size) == ordinal
                free, total = cd.mem_info()
                assert 0 < free <= total
            finally:
                cd.unmap(base + size, size)
                cd.unmap(base, size)
        finally:
            cd.address_free(base, 2 * size)

    cd.release(imported)
    cd.release(handle)

    # the automatic choice: POSIX fd | fabric where an IMEX channel allows it, else POSIX fd alone;
    # whatever was granted is what the allocation carries, and the POSIX fd always exports
    handle, types = cd.create(size, ordinal)
    try:
        prop = cd._call("cuMemGetAllocationPropertiesFromHandle", handle)
        assert struct.unpack("<i", ctypes.string_at(prop.getPtr() + 4, 4))[0] == types
        fd = cd.export_fd(handle)
        os.close(fd)
        if types & cd.CU_MEM_HANDLE_TYPE_FABRIC:
            fabric = cd.export_fabric(handle)
            assert len(fabric) == cd.FABRIC_HANDLE_SIZE
            cd.release(cd.import_fabric(fabric))
        else:
            assert types == posix
            refusal = cd.fabric_refusal(ordinal)
            assert isinstance(refusal, cd.CudaError) and refusal.result in cd.FABRIC_FALLBACK_RESULTS
    finally:
        cd.release(handle)

    # a driver error names the call, the result and the driver's description
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(cd.CudaError) as ei:
            cd.import_fd(fd)
    finally:
        os.close(fd)
    exc = ei.value
    assert not isinstance(exc, cd.CudaUnavailable)
    assert exc.function == "cuMemImportFromShareableHandle" and exc.result not in (None, 0)
    assert exc.result_name.startswith("CUDA_ERROR_"), exc.message
    assert re.search(r"\(\d+\) \[.+\]: fd \d+$", exc.message), exc.message

    assert cd.release_primary_context(ordinal) is True
    assert cd.release_primary_context(ordinal) is False
