"""The cuda backend and the client's CudaMapping.

CPU tests (always run): the driver wrapper fails cleanly without a driver, UUID
parsing, the DLPack bridge. GPU tests (``gpu``/``gpu2``
markers, skipped without CUDA): daemon-side allocate/initialize/export, import and
contiguous mapping, cross-process fd passing over SCM_RIGHTS with the exporter
exiting first, peer rows on other GPUs, the daemon's context overhead (printed:
run with ``-s`` to see it), the fabric handle fallback, host registration.

Child processes are started with multiprocessing's spawn method and talk to the
test over an AF_UNIX socket (results as JSON, fds with SCM_RIGHTS). Exporter
children never touch torch's CUDA: they are the daemon.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from a2ad import cuda_driver as cd
from a2ad import errors

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _ensure_cuda_map_importable() -> None:
    """``a2ad.client.cuda_map`` needs only torch and the driver wrapper; when the client
    package itself cannot be imported here (not pip-installed, or its zmq/msgpack
    dependencies missing), expose the client folder as a bare ``a2ad.client`` package."""
    try:
        import a2ad.client.cuda_map  # noqa: F401
    except ImportError:
        import types

        import a2ad

        for name in [m for m in sys.modules if m == "a2ad.client" or m.startswith("a2ad.client.")]:
            del sys.modules[name]
        pkg = types.ModuleType("a2ad.client")
        pkg.__path__ = [str(REPO / "client")]
        sys.modules["a2ad.client"] = pkg
        a2ad.client = pkg


_ensure_cuda_map_importable()


def _gpu_count() -> int:
    # Spawned children re-import this module: they must not probe CUDA here (a
    # child that plays the daemon measures its own context creation).
    if mp.parent_process() is not None:
        return 0
    try:
        if not torch.cuda.is_available():
            return 0
        return cd.device_count()
    except Exception:
        return 0


N_GPUS = _gpu_count()
gpu = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU")]
gpu2 = [pytest.mark.gpu2, pytest.mark.skipif(N_GPUS < 2, reason="needs 2 CUDA GPUs")]


def _apply(marks):
    def deco(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn

    return deco


# ===========================================================================
# CPU tests
# ===========================================================================
def test_device_count_is_clean():
    try:
        n = cd.device_count()
    except cd.CudaError as exc:  # a broken driver: a clean, typed error
        assert isinstance(exc, errors.BackendError)
        assert exc.function and exc.message
        return
    assert isinstance(n, int) and n >= 0
    assert isinstance(cd.available(), bool)


def _run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_driver_library_is_clean():
    """With no loadable libcuda: device_count() == 0, calls raise CudaUnavailable, make_backend is clear."""
    p = _run_py(
        """
        from a2ad import cuda_driver as cd, errors
        from a2ad.daemon.backends import make_backend, cuda_available
        assert cd.device_count() == 0
        assert cd.available() is False and cuda_available() is False
        try:
            cd.uuid_of(0)
        except cd.CudaUnavailable as exc:
            assert isinstance(exc, errors.BackendError)
            assert "libcuda" in exc.message, exc.message
        else:
            raise AssertionError("uuid_of(0) did not raise")
        try:
            make_backend("cuda")
        except errors.BackendError as exc:
            assert "GPU" in str(exc) and "host" in str(exc), str(exc)
        else:
            raise AssertionError("make_backend('cuda') did not raise")
        assert make_backend("auto").name == "host"
        print("ok")
        """,
        A2AD_LIBCUDA="/nonexistent/libcuda.so.1",
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


@pytest.mark.skipif(N_GPUS > 0, reason="a GPU is present")
def test_make_backend_cuda_without_gpu_raises_backend_error():
    from a2ad.daemon.backends import make_backend

    with pytest.raises(errors.BackendError, match="GPU"):
        make_backend("cuda")


def test_cuda_error_message_names_function_and_result():
    exc = cd.CudaError("cuMemCreate", cd.CUDA_ERROR_OUT_OF_MEMORY, "4096 bytes on device 0")
    assert isinstance(exc, errors.BackendError)
    assert "cuMemCreate" in exc.message and "CUDA_ERROR_OUT_OF_MEMORY" in exc.message
    assert exc.details["cuda_error"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert cd.error_name(cd.CUDA_ERROR_NOT_PERMITTED) == "CUDA_ERROR_NOT_PERMITTED"
    assert cd.error_name(123456).startswith(("CUresult", "CUDA_ERROR"))


def test_uuid_formats():
    raw = bytes(range(16))
    s = cd.format_uuid(raw)
    assert s == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    hexs = raw.hex()
    assert cd.normalize_uuid(s) == hexs
    assert cd.normalize_uuid(s.upper()) == hexs
    assert cd.normalize_uuid(s[4:]) == hexs  # torch's bare spelling
    assert cd.normalize_uuid("MIG-" + s[4:]) == hexs
    for bad in ("0", "host", "GPU-0001", "", "GPU-zz010203-0405-0607-0809-0a0b0c0d0e0f", None, 3):
        assert cd.normalize_uuid(bad) is None
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cd.device_by_uuid("cuda:0")


def test_backend_rejects_bad_device_strings_without_touching_gpus():
    from a2ad.daemon.backends.cuda import CudaBackend

    b = CudaBackend()
    for bad in ("host", "cuda:0", "0", "GPU-nope", 7):
        with pytest.raises(errors.InvalidField) as ei:
            b.check_device(bad)
        assert ei.value.details.get("field") == "device"
    with pytest.raises(errors.InvalidField, match="no visible GPU"):
        b.check_device("GPU-00000000-0000-0000-0000-000000000000")
    d = b.describe()
    assert d["backend"] == "cuda" and d["handle_type"] == "posix_fd"


def test_dlpack_bridge_is_zero_copy_and_keeps_owner_alive():
    import gc
    import weakref

    from a2ad.client import cuda_map as cm

    buf = (ctypes.c_uint8 * 256)(*range(256))

    class Owner:
        pass

    owner = Owner()
    ref = weakref.ref(owner)
    t = cm._tensor_from_pointer(ctypes.addressof(buf), 256, cm.kDLCPU, 0, owner)
    assert t.dtype == torch.uint8 and t.shape == (256,) and t.data_ptr() == ctypes.addressof(buf)
    v = t.as_strided((4, 32), (64, 1))
    t[65] = 0xEE
    assert buf[65] == 0xEE and int(v[1, 1]) == 0xEE
    del owner, t
    gc.collect()
    assert ref() is not None  # the view still holds the storage
    del v
    gc.collect()
    assert ref() is None


# ===========================================================================
# GPU helpers (also run in spawned children)
# ===========================================================================
def _pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def _send_json(s: socket.socket, obj, fds=()) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(s, [len(data).to_bytes(4, "little") + data], list(fds))
    else:
        s.sendall(len(data).to_bytes(4, "little") + data)


def _recv_json(s: socket.socket, maxfds: int = 0):
    """One length-prefixed JSON message (and the fds that came with its first bytes)."""
    fds: list[int] = []
    if maxfds:
        head, fds, _, _ = socket.recv_fds(s, 4, maxfds)
    else:
        head = s.recv(4)
    while len(head) < 4:
        more = s.recv(4 - len(head))
        if not more:
            raise ConnectionError("peer closed")
        head += more
    n = int.from_bytes(head[:4], "little")
    body = b""
    while len(body) < n:
        more = s.recv(n - len(body))
        if not more:
            raise ConnectionError("peer closed")
        body += more
    return json.loads(body), fds


def _write_through_temp_mapping(ordinal: int, handle: int, size: int, offset: int, data: bytes) -> None:
    with cd.on_device(ordinal):
        ptr = cd.reserve(size, cd.granularity(ordinal))
        try:
            cd.map(ptr, size, handle)
            try:
                cd.set_access(ptr, size, ordinal)
                cd.memcpy_htod(ptr + offset, data)
                cd.synchronize()
            finally:
                cd.unmap(ptr, size)
        finally:
            cd.address_free(ptr, size)


# --- children -----------------------------------------------------------------
def _child_exporter(path: str, ordinal: int, size: int, aux: int, rnd: int, seed: int, wait_ack: bool) -> None:
    """The daemon's side, no torch CUDA: allocate, initialize, write a pattern after the aux
    region, send the fd over SCM_RIGHTS, release everything and exit."""
    from a2ad.daemon.backends.cuda import CudaBackend

    with _connect(path) as s:
        be = CudaBackend()
        a = be.allocate(size, cd.uuid_of(ordinal))
        be.initialize(a, aux, 0, rnd)
        _write_through_temp_mapping(ordinal, a.extra["handle"], a.size, aux, _pattern(seed, 4096))
        _send_json(s, {"row_stride": a.size, "handle_type": a.handle_type}, [a.fd])
        if wait_ack:
            assert s.recv(1) == b"k"
        be.release(a)
        be.close()
    os._exit(0)  # no interpreter teardown: the process is gone as abruptly as a crashed daemon


def _child_overhead(path: str, ordinal: int) -> None:
    """As the daemon: allocate + initialize with the default (transient) context policy, then
    with a kept context; report describe() and the free-memory readings around each."""
    from a2ad.daemon.backends.cuda import CudaBackend

    with _connect(path) as s:
        assert not torch.cuda.is_initialized()
        uuid = cd.uuid_of(ordinal)
        out = {"free0": cd.nvml_free_bytes(uuid)}
        be = CudaBackend()
        a = be.allocate(4 * MiB, uuid)
        out["free_after_alloc"] = cd.nvml_free_bytes(uuid)
        be.initialize(a, 64 * 1024, 0, 1)
        out["free_after_init"] = cd.nvml_free_bytes(uuid)
        out["row_bytes"] = a.size
        out["describe"] = be.describe()
        out["handle_type"] = a.handle_type
        kept = CudaBackend(keep_context=True)
        b = kept.allocate(4 * MiB, uuid)
        kept.initialize(b, 64 * 1024, 0, 1)
        out["free_after_kept_init"] = cd.nvml_free_bytes(uuid)
        out["describe_kept"] = kept.describe()
        kept.release(b)
        kept.close()
        out["active_after_close"] = cd.primary_context_active(ordinal)
        be.release(a)
        be.close()
        out["torch_initialized"] = torch.cuda.is_initialized()
        _send_json(s, out)


def _child_client(path: str, ordinal: int, me: int, size_per_rank: int) -> None:
    """A client: receive every rank's fd, map, write own marker into every row (peer writes included)."""
    from a2ad.client.cuda_map import CudaMapping

    torch.cuda.set_device(ordinal)
    with _connect(path) as s:
        info, fds = _recv_json(s, maxfds=64)
        m = CudaMapping(fds, size_per_rank, info["row_stride"], ordinal)
        for fd in fds:
            os.close(fd)
        ws = m.tensor
        for q in range(m.ep_size):
            ws[q, 4096 + me * 256 : 4096 + (me + 1) * 256].fill_(me + 1)
        torch.cuda.synchronize()
        _send_json(s, {"wrote": True, "device": str(ws.device), "stride": list(ws.stride())})
        assert s.recv(1) == b"x"  # keep the mapping until the test has looked
        m.close()
    os._exit(0)


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


class _Listener:
    """An AF_UNIX listening socket in a short private folder."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="a2ad-cu-")
        self.path = os.path.join(self.dir, "s")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.sock.settimeout(120)

    def accept(self) -> socket.socket:
        c, _ = self.sock.accept()
        c.settimeout(120)
        return c

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def listener():
    lst = _Listener()
    yield lst
    lst.close()


def _join(p, timeout=60):
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(5)
        raise AssertionError("child did not exit")
    return p.exitcode


# ===========================================================================
# GPU tests
# ===========================================================================
@_apply(gpu)
def test_uuid_agrees_with_torch():
    for i in range(N_GPUS):
        ours = cd.uuid_of(i)
        theirs = str(torch.cuda.get_device_properties(i).uuid)
        assert cd.normalize_uuid(theirs) == cd.normalize_uuid(ours), (ours, theirs)
        assert cd.device_by_uuid(ours) == i
        assert cd.device_by_uuid(theirs) == i
        assert cd.device_by_uuid(f"GPU-{cd.normalize_uuid(theirs)}") == i


@_apply(gpu)
def test_check_device_and_row_stride():
    from a2ad.daemon.backends.cuda import CudaBackend

    b = CudaBackend()
    uuid = cd.uuid_of(0)
    b.check_device(uuid)
    with pytest.raises(errors.InvalidField, match="UUID"):
        b.check_device("0")
    with pytest.raises(errors.InvalidField, match="no visible GPU"):
        b.check_device("GPU-00000000-0000-0000-0000-000000000000")
    g = cd.granularity(0)
    for size in (1, g - 1, g, g + 1, 3 * g + 17):
        st = b.row_stride(size, uuid)
        assert st >= size and st % g == 0 and st - size < max(g, cd.granularity(0, recommended=True)) * 2


@_apply(gpu)
def test_allocate_initialize_import_same_process():
    from a2ad.daemon.backends.cuda import CudaBackend
    from a2ad.client.cuda_map import CudaMapping

    be = CudaBackend()
    uuid = cd.uuid_of(0)
    size = 3 * MiB + 5
    aux, rnd = 96 * 1024, 1
    a = be.allocate(size, uuid)
    try:
        assert a.fd >= 0 and a.size == be.row_stride(size, uuid) and a.device == uuid
        assert a.handle_type in ("posix_fd", "fabric")
        # junk first, so initialize() has to zero it
        _write_through_temp_mapping(0, a.extra["handle"], a.size, 0, b"\xff" * aux)
        be.initialize(a, aux, 0, rnd)

        dup = os.dup(a.fd)
        m = CudaMapping([dup], size, a.size, 0)
        os.close(dup)  # the caller's fd is not needed once imported
        ws = m.tensor
        assert ws.shape == (1, size) and ws.stride() == (a.size, 1)
        assert ws.device == torch.device("cuda", 0) and ws.data_ptr() == m.base_ptr
        assert int(ws[0, :4].view(torch.int32).item()) == rnd
        assert int(ws[0, 4:aux].count_nonzero().item()) == 0

        # a second, independent import sees the first one's writes
        dup = os.dup(a.fd)
        m2 = CudaMapping([dup], size, a.size, 0)
        os.close(dup)
        assert m2.base_ptr != m.base_ptr
        ws[0, aux : aux + 1000].fill_(0x42)
        torch.cuda.synchronize()
        assert bool((m2.tensor[0, aux : aux + 1000] == 0x42).all())

        # the daemon lets go; the importers' mappings stay valid
        be.release(a)
        assert a.fd == -1
        be.release(a)  # idempotent
        m2.tensor[0, -8:].fill_(7)
        torch.cuda.synchronize()
        assert m.tensor[0, -8:].tolist() == [7] * 8
        m2.close()
        m.close()
        m.close()  # idempotent
        assert m.closed and m.tensor is None
    finally:
        be.release(a)
        be.close()


@_apply(gpu)
def test_view_outliving_mapping_object_keeps_memory_mapped():
    import gc

    from a2ad.daemon.backends.cuda import CudaBackend
    from a2ad.client.cuda_map import CudaMapping

    be = CudaBackend()
    a = be.allocate(2 * MiB, cd.uuid_of(0))
    dup = os.dup(a.fd)
    m = CudaMapping([dup], 2 * MiB, a.size, 0)
    os.close(dup)
    be.release(a)
    row = m.tensor[0]
    del m
    gc.collect()
    row.fill_(9)  # still mapped: the tensor holds the driver resources
    torch.cuda.synchronize()
    assert int(row.sum().item()) == 9 * 2 * MiB
    del row
    gc.collect()


@_apply(gpu)
@pytest.mark.parametrize("import_before_exit", [False, True], ids=["fd-in-flight", "imported-first"])
def test_exporter_exits_importer_mapping_survives(listener, import_before_exit):
    """Exporter (daemon-like, driver only) sends the fd over SCM_RIGHTS and exits; the
    importer's mapping stays valid and writable."""
    from a2ad.client.cuda_map import CudaMapping

    size, aux, rnd, seed = 5 * MiB + 1, 64 * 1024, 11, 5
    p = _spawn(_child_exporter, listener.path, 0, size, aux, rnd, seed, import_before_exit)
    with listener.accept() as c:
        info, fds = _recv_json(c, maxfds=1)
        assert len(fds) == 1
        if import_before_exit:
            m = CudaMapping(fds, size, info["row_stride"], 0)
            c.sendall(b"k")
        assert _join(p) == 0
        if not import_before_exit:
            m = CudaMapping(fds, size, info["row_stride"], 0)
    os.close(fds[0])
    try:
        ws = m.tensor
        assert int(ws[0, :4].view(torch.int32).item()) == rnd
        assert int(ws[0, 4:aux].count_nonzero().item()) == 0
        want = torch.frombuffer(bytearray(_pattern(seed, 4096)), dtype=torch.uint8)
        assert torch.equal(ws[0, aux : aux + 4096].cpu(), want)
        ws[0, aux:].fill_(0x5C)
        torch.cuda.synchronize()
        assert int((ws[0, aux:] != 0x5C).sum().item()) == 0
    finally:
        m.close()


def _daemon_to_clients(listener, row_ordinals, client_ordinals):
    """The test process plays the daemon: one row per rank on row_ordinals[q], fds over
    SCM_RIGHTS to one spawned client per rank; every client writes its marker into every
    row; the daemon-side view (its own import) checks all of them."""
    from a2ad.daemon.backends.cuda import CudaBackend
    from a2ad.client.cuda_map import CudaMapping

    ep = len(row_ordinals)
    size = 2 * MiB + 3
    be = CudaBackend()
    allocs = [be.allocate(size, cd.uuid_of(o)) for o in row_ordinals]
    stride = allocs[0].size
    assert all(al.size == stride for al in allocs)
    for al in allocs:
        be.initialize(al, 4096, 0, 1)
    procs, conns = [], []
    view = None
    try:
        for me, o in enumerate(client_ordinals):
            procs.append(_spawn(_child_client, listener.path, o, me, size))
            c = listener.accept()
            conns.append(c)
            _send_json(c, {"row_stride": stride}, [al.fd for al in allocs])
        reports = [_recv_json(c)[0] for c in conns]
        for me, (r, o) in enumerate(zip(reports, client_ordinals)):
            assert r["device"] == f"cuda:{o}" and r["stride"] == [stride, 1], r
        # our own view, on the first row's GPU
        dups = [os.dup(al.fd) for al in allocs]
        view = CudaMapping(dups, size, stride, row_ordinals[0])
        for fd in dups:
            os.close(fd)
        ws = view.tensor.cpu()
        for q in range(ep):
            for me in range(len(client_ordinals)):
                seg = ws[q, 4096 + me * 256 : 4096 + (me + 1) * 256]
                assert bool((seg == me + 1).all()), f"row {q} lacks client {me}'s write"
        for c in conns:
            c.sendall(b"x")
        for p in procs:
            assert _join(p) == 0
    finally:
        for c in conns:
            c.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if view is not None:
            view.close()
        for al in allocs:
            be.release(al)
        be.close()


@_apply(gpu)
def test_daemon_sends_fds_to_two_client_processes(listener):
    _daemon_to_clients(listener, [0, 0], [0, 0])


@_apply(gpu2)
def test_peer_rows_on_two_gpus_two_processes(listener):
    """Rank q's row lives on GPU q; each client maps both rows and writes into the peer's (NVLink)."""
    _daemon_to_clients(listener, [0, 1], [0, 1])


@_apply(gpu2)
def test_peer_rows_in_one_process():
    """One process, mapping on GPU 1 writes into a row on GPU 0; a mapping on GPU 0 reads it."""
    from a2ad.daemon.backends.cuda import CudaBackend
    from a2ad.client.cuda_map import CudaMapping

    be = CudaBackend()
    allocs = [be.allocate(MiB, cd.uuid_of(o)) for o in (0, 1)]
    stride = allocs[0].size
    try:
        dups = [os.dup(al.fd) for al in allocs]
        m1 = CudaMapping(dups, MiB, stride, 1)
        m0 = CudaMapping(dups, MiB, stride, 0)
        for fd in dups:
            os.close(fd)
        assert m1.tensor.device == torch.device("cuda", 1)
        assert m0.tensor.device == torch.device("cuda", 0)
        m1.tensor[0].fill_(0x11)  # GPU 1 writes GPU 0's memory
        m0.tensor[1].fill_(0x22)  # GPU 0 writes GPU 1's memory
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        assert bool((m0.tensor[0] == 0x11).all())
        assert bool((m1.tensor[1] == 0x22).all())
        assert cd.pointer_device_ordinal(m1.row_ptr(0)) in (0, 1)  # informational: driver's view
        m1.close()
        m0.close()
    finally:
        for al in allocs:
            be.release(al)


@_apply(gpu)
def test_daemon_context_overhead_measured(listener):
    """In a fresh process (no torch CUDA), as the daemon: what its CUDA context costs per GPU,
    and that with the default transient policy it holds none between setups."""
    p = _spawn(_child_overhead, listener.path, 0)
    with listener.accept() as c:
        r, _ = _recv_json(c)
    assert _join(p) == 0
    assert r["torch_initialized"] is False
    dev = r["describe"]["devices"][0]
    kept = r["describe_kept"]["devices"][0]
    ov = dev["context_overhead_bytes"]
    print(
        f"\n[cuda backend] GPU 0 {dev.get('name')} {dev.get('uuid')}: daemon context overhead {ov} bytes "
        f"(created in {dev.get('context_create_seconds')} s); handle type {r['handle_type']}\n"
        f"[cuda backend] transient policy: describe={json.dumps(r['describe'])}\n"
        f"[cuda backend] kept policy: describe={json.dumps(r['describe_kept'])}"
    )
    assert r["describe"]["context_policy"] == "transient" and r["describe_kept"]["context_policy"] == "kept"
    assert dev["context_active"] is False  # released after initialize()
    assert kept["context_active"] is True
    assert r["active_after_close"] is False
    assert dev["workspace_bytes"] == r["row_bytes"]
    if r["free0"] is None:  # no NVML: nothing measurable
        assert ov is None
        return
    assert isinstance(ov, int) and 0 < ov < 4 << 30, ov
    steady = r["free0"] - r["free_after_init"] - r["row_bytes"]
    print(f"[cuda backend] daemon steady-state overhead with the transient policy: {steady} bytes")
    assert steady < 32 * MiB, steady
    assert r["free0"] - r["free_after_alloc"] - r["row_bytes"] < 32 * MiB  # allocation needs no context


@_apply(gpu)
def test_fabric_fallback_reported():
    from a2ad.daemon.backends.cuda import CudaBackend

    be = CudaBackend()
    a = be.allocate(MiB, cd.uuid_of(0))
    try:
        d = be.describe()
        assert d["handle_type"] == a.handle_type
        if a.handle_type == "fabric":
            assert len(a.extra["fabric_handle"]) == cd.FABRIC_HANDLE_SIZE
            print("\n[cuda backend] fabric handles available (IMEX channel present)")
        else:
            refusal = cd.fabric_refusal(0)
            why = refusal.result_name if refusal else a.extra.get("fabric_error")
            assert why, "fallback to POSIX fd without a recorded reason"
            print(f"\n[cuda backend] fabric refused ({why}); using posix_fd")
            assert d["devices"][0].get("fabric_refused") or a.extra.get("fabric_error")
    finally:
        be.release(a)
    b2 = CudaBackend(try_fabric=False)
    a2 = b2.allocate(MiB, cd.uuid_of(0))
    try:
        assert a2.handle_type == "posix_fd"
        assert a2.extra["handle_types"] == cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    finally:
        b2.release(a2)


@_apply(gpu)
def test_mapping_rejects_bad_geometry():
    from a2ad.daemon.backends.cuda import CudaBackend
    from a2ad.client.cuda_map import CudaMapping

    be = CudaBackend()
    a = be.allocate(MiB, cd.uuid_of(0))
    try:
        with pytest.raises(ValueError):
            CudaMapping([a.fd], a.size + 1, a.size, 0)
        with pytest.raises(ValueError, match="granularity"):
            CudaMapping([a.fd], 100, a.size - 4096, 0)
        with pytest.raises(cd.CudaError, match="cuMemImportFromShareableHandle|cuMemMap"):
            fd = os.open("/dev/null", os.O_RDONLY)
            try:
                CudaMapping([fd], 100, a.size, 0)
            finally:
                os.close(fd)
    finally:
        be.release(a)
