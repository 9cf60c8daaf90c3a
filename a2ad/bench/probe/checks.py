"""The probe's checks, run in the parent process, and :class:`Checks`, their record.

Each ``check_*`` returns a one-line detail when it passes and raises when it fails; the
measurements go to ``Checks.data``. The checks that need a fresh process run one of the
bodies in :mod:`a2ad.bench.probe.children`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import traceback

from a2ad import cuda_driver as cd

from .children import MiB, _client_package, _pattern, child_command, child_env, parse_result, run_child


class Checks:
    """The checks run so far, as ``(status, name, detail)`` rows (status PASS, FAIL or WARN),
    and the measurements they gathered (``data``)."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []
        self.data: dict = {}

    def run(self, name: str, fn, required: bool = True):
        """Run one check; a failure counts as FAIL when ``required``, as WARN otherwise. True when it passed."""
        t0 = time.time()
        print(f"\n=== {name}", flush=True)
        try:
            detail = fn()
            status = "PASS"
        except Exception as exc:
            traceback.print_exc()
            detail = f"{type(exc).__name__}: {exc}"
            status = "FAIL" if required else "WARN"
        detail = "" if detail is None else str(detail)
        print(f"--- {status} {name} ({time.time() - t0:.1f}s) {detail}", flush=True)
        self.rows.append((status, name, detail))
        return status == "PASS"

    @property
    def failed(self) -> bool:
        """Whether a required check failed."""
        return any(s == "FAIL" for s, _, _ in self.rows)


def check_inventory(c: Checks) -> str:
    print(f"cuda-bindings {cd.bindings_version() or '(not installed)'}")
    v = cd.driver_version()
    n = cd.device_count()
    print(f"driver CUDA version: {v // 1000}.{(v % 1000) // 10}  ({v})")
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}; {n} visible device(s)")
    devs = []
    for i in range(n):
        d = {
            "ordinal": i,
            "uuid": cd.uuid_of(i),
            "name": cd.device_name(i),
            "pci": cd.pci_bus_id(i),
            "total_mem": cd.total_memory(i),
            "cc": f"{cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, i)}."
            f"{cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, i)}",
            "vmm": cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, i),
            "posix_fd": cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, i),
            "fabric": cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, i),
            "gran_min": cd.granularity(i),
            "gran_rec": cd.granularity(i, recommended=True),
            "host_ptr_for_registered": cd.device_attribute(
                cd.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, i
            ),
        }
        devs.append(d)
        print(
            f"  [{i}] {d['uuid']}  {d['name']}  pci {d['pci']}  cc {d['cc']}  {d['total_mem'] / 2**30:.1f} GiB  "
            f"vmm={d['vmm']} posix_fd={d['posix_fd']} fabric={d['fabric']}  granularity min={d['gran_min']} "
            f"rec={d['gran_rec']}"
        )
    for i in range(n):
        for j in range(n):
            if i != j:
                print(f"  peer access {i} -> {j}: {cd.can_access_peer(i, j)}")
    c.data["driver_version"] = v
    c.data["cuda_bindings"] = cd.bindings_version()
    c.data["devices"] = devs
    if n == 0:
        raise RuntimeError("no visible GPU")
    return f"{n} GPU(s), driver CUDA {v}"


def _recorded_child(c: Checks, name: str, ordinal: int) -> dict:
    """Run child ``name`` on GPU ``ordinal``, keep and print its result; raise when it failed."""
    r = run_child([name, ordinal])
    c.data.setdefault(name, {})[ordinal] = r
    print(json.dumps(r, indent=2))
    if not r.get("ok"):
        raise RuntimeError(r.get("error") or r.get("stderr_tail"))
    return r


def check_fabric(c: Checks, ordinal: int) -> str:
    r = _recorded_child(c, "fabric", ordinal)
    if r["posix_fd"].get("export_fd") != "ok":
        raise RuntimeError(f"POSIX-fd export failed: {r['posix_fd']}")
    return f"auto handle type: {r['auto_handle_type']}; fabric alone: {r['fabric']}"


def check_overhead(c: Checks, ordinal: int) -> str:
    r = _recorded_child(c, "overhead", ordinal)
    t = run_child(["torch_overhead", ordinal])
    c.data.setdefault("torch_overhead", {})[ordinal] = t
    ctx = (r.get("context") or {}).get("bytes")
    tb = t.get("torch_context_bytes")

    def mib(x):
        return "n/a" if x is None else f"{x / MiB:.0f} MiB"

    return (
        f"daemon context {mib(ctx)} (created in {(r.get('context') or {}).get('seconds') or 0:.3f} s); "
        f"held between setups: transient {mib(r.get('daemon_steady_bytes_transient'))}, "
        f"kept {mib(r.get('daemon_steady_bytes_kept'))}; torch context {mib(tb)}"
    )


def check_exporter_exits(c: Checks, exp_ordinal: int, imp_ordinal: int) -> str:
    """Exporter child allocates, sends the fd, exits; then we import (with torch) and verify."""
    import torch

    _client_package()
    from a2ad.client.cuda_map import CudaMapping

    size, aux, rnd, seed = 8 * MiB + 123, 64 * 1024, 7, 3
    a, b = socket.socketpair()
    try:
        r = run_child(["export", exp_ordinal, b.fileno(), size, aux, rnd, seed], pass_fds=[b.fileno()])
        b.close()
        if not r.get("ok"):
            raise RuntimeError(r.get("error") or r.get("stderr_tail"))
        msg, fds, _, _ = socket.recv_fds(a, 4096, 1)
    finally:
        a.close()
        if b.fileno() >= 0:
            b.close()
    info = json.loads(msg)
    assert r["returncode"] == 0
    m = CudaMapping(fds, size, info["size"], imp_ordinal)
    os.close(fds[0])
    try:
        ws = m.tensor
        assert ws.shape == (1, size) and ws.stride() == (info["size"], 1), (ws.shape, ws.stride())
        assert ws.device == torch.device("cuda", imp_ordinal)
        flag = int(ws[0, :4].view(torch.int32).item())
        assert flag == rnd, f"flag {flag} != {rnd}"
        assert int(ws[0, 4:aux].count_nonzero().item()) == 0, "aux region not zeroed"
        pat = torch.frombuffer(bytearray(_pattern(seed, 4096)), dtype=torch.uint8)
        assert torch.equal(ws[0, aux : aux + 4096].cpu(), pat), "pattern written by the exporter not seen"
        ws[0, -1000:].fill_(0xA5)
        torch.cuda.synchronize()
        assert bool((ws[0, -1000:].cpu() == 0xA5).all())
    finally:
        m.close()
    m.close()  # idempotent
    return f"exporter on GPU {exp_ordinal} exited (rc 0) before the import on GPU {imp_ordinal}; data intact, writable"


def check_cross_gpu(c: Checks, ordinals: list[int]) -> str:
    """Rows on each GPU (allocated here through the backend), one importer per GPU writing into peers."""
    from a2ad.daemon.backends.cuda import CudaBackend

    ep = len(ordinals)
    be = CudaBackend()
    size = 4 * MiB
    allocs = [be.allocate(size, cd.uuid_of(o)) for o in ordinals]
    stride = allocs[0].size
    for al in allocs:
        be.initialize(al, 4096, 0, 1)
    socks, procs = [], []
    try:
        for me, o in enumerate(ordinals):
            a, b = socket.socketpair()
            cmd = child_command("import_write", o, b.fileno(), size, me, ep)
            p = subprocess.Popen(cmd, pass_fds=[b.fileno()], env=child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            b.close()
            socket.send_fds(a, [json.dumps({"row_stride": stride}).encode()], [al.fd for al in allocs])
            socks.append(a)
            procs.append(p)
        for a in socks:
            a.settimeout(120)
            assert a.recv(1) == b"w"
        for a in socks:
            a.sendall(b"c")
        for a in socks:
            assert a.recv(1) == b"d"
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            res = parse_result(out)
            if res is None or p.returncode != 0:
                raise RuntimeError(f"importer failed rc={p.returncode}: {err[-2000:]}")
            results.append(res)
        print(json.dumps(results, indent=2))
        bad = [r for r in results if not r["ok"]]
        if bad:
            raise RuntimeError(f"peer writes not seen: {bad}")
    finally:
        for a in socks:
            a.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for al in allocs:
            be.release(al)
    return f"{ep} importers on GPUs {ordinals} each wrote into every peer's row and saw every peer's writes"


def check_hidden_gpu(c: Checks, mem_ordinal: int, imp_ordinal: int) -> str:
    """Memory on GPU mem_ordinal, importer sees only GPU imp_ordinal (CUDA_VISIBLE_DEVICES)."""
    from a2ad.daemon.backends.cuda import CudaBackend

    be = CudaBackend()
    al = be.allocate(2 * MiB, cd.uuid_of(mem_ordinal))
    be.initialize(al, 4096, 0, 1)
    a, b = socket.socketpair()
    try:
        cmd = child_command("import_hidden", 0, b.fileno(), 2 * MiB)
        env = child_env({"CUDA_VISIBLE_DEVICES": cd.uuid_of(imp_ordinal)})
        p = subprocess.Popen(cmd, pass_fds=[b.fileno()], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        b.close()
        socket.send_fds(a, [json.dumps({"row_stride": al.size}).encode()], [al.fd])
        a.settimeout(120)
        a.recv(1)
        out, err = p.communicate(timeout=120)
    finally:
        a.close()
        be.release(al)
    res = parse_result(out)
    if res is None:
        raise RuntimeError(f"child failed: {err[-2000:]}")
    print(json.dumps(res, indent=2))
    c.data["hidden_gpu_import"] = res
    if res["result"] != "mapped and wrote":
        raise RuntimeError(res["result"])
    return res["result"]
