#!/usr/bin/env python3
"""Probe what the cuda backend relies on, on a real GPU machine, in one go.

    python scripts/gpu-probe.py            # from the repository root (or anywhere)
    python scripts/gpu-probe.py --json out.json

Prints the driver version and every visible GPU, tries POSIX-fd and fabric
export, measures the daemon's per-GPU context overhead (in fresh processes that
never import torch, as the daemon), does an export/import round trip across
two processes (the exporter exits before the importer maps), and, with two or
more GPUs, a cross-GPU round trip: one row on each GPU, one importer per GPU,
each writes into the *other* GPU's row through its own mapping (peer access
through cuMemSetAccess only), then each reads what the other wrote. Ends with a
PASS/FAIL summary; exit status 1 when a required check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _bootstrap_client_package() -> None:
    """Make ``a2ad.client`` importable from a source checkout that is not pip-installed."""
    try:
        import a2ad.client.cuda_map  # noqa: F401

        return
    except ImportError:
        pass
    import a2ad

    pkg = types.ModuleType("a2ad.client")
    pkg.__path__ = [os.path.join(REPO, "client")]
    sys.modules["a2ad.client"] = pkg
    a2ad.client = pkg


_bootstrap_client_package()

from a2ad import cuda_driver as cd  # noqa: E402

MiB = 1 << 20
RESULT_TAG = "RESULT "


def _emit(obj) -> None:
    print(RESULT_TAG + json.dumps(obj), flush=True)


def _run_child(args: list[str], env_extra: dict | None = None, pass_fds=(), timeout=120) -> dict:
    env = dict(os.environ)
    env.update(env_extra or {})
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    p = subprocess.run(cmd, env=env, pass_fds=pass_fds, capture_output=True, text=True, timeout=timeout)
    result = None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    if result is None:
        result = {"ok": False, "error": f"child exited {p.returncode} without a result"}
    if p.returncode != 0 or not result.get("ok", True):
        result.setdefault("stderr_tail", p.stderr[-3000:])
    result["returncode"] = p.returncode
    return result


# ---------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------
def child_overhead(ordinal: int) -> None:
    """As the daemon (no torch): what the CUDA context costs, and what the daemon holds
    between setups with the default (transient) and the kept context policy."""
    assert "torch" not in sys.modules
    from a2ad.daemon.backends.cuda import CudaBackend

    uuid = cd.uuid_of(ordinal)
    out = {"ok": True, "ordinal": ordinal, "uuid": uuid}
    free0 = out["nvml_free_before"] = cd.nvml_free_bytes(uuid)
    size = 64 * MiB

    def nv():
        return cd.nvml_free_bytes(uuid)

    be = CudaBackend()
    t0 = time.perf_counter()
    a = be.allocate(size, uuid)
    out["allocate_seconds"] = time.perf_counter() - t0
    free_alloc = nv()
    t0 = time.perf_counter()
    be.initialize(a, 1 * MiB, 0, 1)
    out["initialize_seconds_transient"] = time.perf_counter() - t0
    free_init = nv()
    out["context"] = cd.context_overhead(ordinal)
    out["row_bytes"] = a.size
    out["handle_type"] = a.handle_type
    if a.extra.get("fabric_error"):
        out["fabric_error"] = a.extra["fabric_error"]
    out["describe_transient"] = be.describe()
    kept = CudaBackend(keep_context=True)
    b = kept.allocate(size, uuid)
    t0 = time.perf_counter()
    kept.initialize(b, 1 * MiB, 0, 1)
    kept.initialize(b, 1 * MiB, 0, 1)
    out["initialize_seconds_kept_x2"] = time.perf_counter() - t0
    free_kept = nv()
    with cd.on_device(ordinal):
        free_cu, total_cu = cd.mem_info()
    out["cuMemGetInfo_with_kept_context"] = {"free": free_cu, "total": total_cu}
    out["describe_kept"] = kept.describe()
    out["nvidia_smi_process_mib"] = _nvidia_smi_usage(os.getpid())
    if None not in (free0, free_alloc, free_init, free_kept):
        out["allocate_without_context_extra_bytes"] = free0 - free_alloc - a.size
        out["daemon_steady_bytes_transient"] = free0 - free_init - a.size
        out["daemon_steady_bytes_kept"] = free0 - free_kept - a.size - b.size
    kept.release(b)
    kept.close()
    be.release(a)
    be.close()
    _emit(out)


def _nvidia_smi_usage(pid: int):
    try:
        p = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = []
    for line in p.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0] == str(pid):
            rows.append({"gpu": parts[1], "used_mib": parts[2]})
    return rows


def child_torch_overhead(ordinal: int) -> None:
    """For comparison: what a torch process pays for its CUDA context on the same GPU."""
    uuid = cd.uuid_of(ordinal)
    before = cd.nvml_free_bytes(uuid)
    import torch

    torch.cuda.set_device(ordinal)
    x = torch.ones(1, device=f"cuda:{ordinal}")
    (x + 1).sum().item()
    torch.cuda.synchronize()
    after = cd.nvml_free_bytes(uuid)
    _emit({"ok": True, "ordinal": ordinal, "torch_context_bytes": None if before is None else before - after})


def child_fabric(ordinal: int) -> None:
    """Try each handle type explicitly and report what the driver says."""
    out = {"ok": True, "ordinal": ordinal}
    out["attr_posix_fd_supported"] = cd.device_attribute(
        cd.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, ordinal
    )
    out["attr_fabric_supported"] = cd.device_attribute(cd.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, ordinal)
    with cd.on_device(ordinal):
        g = cd.granularity(ordinal)
        for label, types_ in (
            ("posix_fd", cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            ("fabric", cd.CU_MEM_HANDLE_TYPE_FABRIC),
            ("posix_fd|fabric", cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | cd.CU_MEM_HANDLE_TYPE_FABRIC),
        ):
            entry = {}
            try:
                h, _ = cd.create(g, ordinal, types_)
                entry["create"] = "ok"
                if types_ & cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
                    try:
                        fd = cd.export_fd(h)
                        os.close(fd)
                        entry["export_fd"] = "ok"
                    except cd.CudaError as exc:
                        entry["export_fd"] = exc.result_name
                if types_ & cd.CU_MEM_HANDLE_TYPE_FABRIC:
                    try:
                        fh = cd.export_fabric(h)
                        entry["export_fabric"] = f"ok ({len(fh)} bytes)"
                    except cd.CudaError as exc:
                        entry["export_fabric"] = exc.result_name
                cd.release(h)
            except cd.CudaError as exc:
                entry["create"] = exc.result_name
            out[label] = entry
        # the automatic path the backend uses
        h, types_ = cd.create(g, ordinal, None)
        cd.release(h)
        out["auto_handle_types"] = types_
        out["auto_handle_type"] = "fabric" if types_ & cd.CU_MEM_HANDLE_TYPE_FABRIC else "posix_fd"
        refusal = cd.fabric_refusal(ordinal)
        out["auto_fabric_refusal"] = refusal.message if refusal else None
    _emit(out)


def _pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


def child_export(ordinal: int, sock_fd: int, size: int, aux: int, flag_round: int, pattern_seed: int) -> None:
    """Exporter (as the daemon, no torch): allocate + initialize, write a pattern after the aux
    region through a temporary mapping, send the fd over SCM_RIGHTS, then exit without waiting."""
    assert "torch" not in sys.modules
    from a2ad.daemon.backends.cuda import CudaBackend

    be = CudaBackend()
    uuid = cd.uuid_of(ordinal)
    a = be.allocate(size, uuid)
    be.initialize(a, aux, 0, flag_round)
    pat = _pattern(pattern_seed, 4096)
    with cd.on_device(ordinal):
        ptr = cd.reserve(a.size, cd.granularity(ordinal))
        cd.map(ptr, a.size, a.extra["handle"])
        cd.set_access(ptr, a.size, ordinal)
        cd.memcpy_htod(ptr + aux, pat)
        cd.synchronize()
        cd.unmap(ptr, a.size)
        cd.address_free(ptr, a.size)
    s = socket.socket(fileno=sock_fd)
    msg = json.dumps({"size": a.size, "handle_type": a.handle_type}).encode()
    socket.send_fds(s, [msg], [a.fd])
    s.close()
    # exit holding nothing: release the daemon-side handle and fd first (the receiver's fd keeps the memory)
    be.release(a)
    _emit({"ok": True, "row_bytes": a.size, "handle_type": a.handle_type})


def child_import_write(ordinal: int, sock_fd: int, size_per_rank: int, me: int, ep: int) -> None:
    """Importer with torch: receive ep fds, map, write own marker into every peer's row,
    wait for a 'check' byte, then verify every peer wrote into our row."""
    import torch

    from a2ad.client.cuda_map import CudaMapping

    torch.cuda.set_device(ordinal)
    s = socket.socket(fileno=sock_fd)
    msg, fds, _, _ = socket.recv_fds(s, 4096, ep)
    info = json.loads(msg)
    m = CudaMapping(fds, size_per_rank, info["row_stride"], ordinal)
    for fd in fds:
        os.close(fd)
    ws = m.tensor
    # rank `me` writes byte (me+1) into [me*64, me*64+64) of every row q != me (peer writes)
    for q in range(ep):
        if q != me:
            ws[q, me * 64 : me * 64 + 64].fill_(me + 1)
    torch.cuda.synchronize()
    s.sendall(b"w")
    assert s.recv(1) == b"c"
    got = {}
    ok = True
    for src in range(ep):
        if src != me:
            vals = ws[me, src * 64 : src * 64 + 64].cpu()
            good = bool((vals == src + 1).all())
            got[src] = good
            ok &= good
    s.sendall(b"d")
    s.close()
    m.close()
    _emit({"ok": ok, "me": me, "ordinal": ordinal, "peers_seen": got})


def child_import_hidden(ordinal: int, sock_fd: int, size_per_rank: int) -> None:
    """Importer run with CUDA_VISIBLE_DEVICES hiding the GPU the memory lives on."""
    import torch

    from a2ad.client.cuda_map import CudaMapping

    s = socket.socket(fileno=sock_fd)
    msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    info = json.loads(msg)
    out = {"ok": True, "visible": cd.visible_uuids()}
    try:
        m = CudaMapping(fds, size_per_rank, info["row_stride"], ordinal)
        m.tensor[0, :16].fill_(0x5A)
        torch.cuda.synchronize()
        out["wrote"] = bool((m.tensor[0, :16].cpu() == 0x5A).all())
        m.close()
        out["result"] = "mapped and wrote"
    except Exception as exc:  # reported, not fatal: this documents a deployment constraint
        out["result"] = f"{type(exc).__name__}: {exc}"
    for fd in fds:
        os.close(fd)
    s.sendall(b"d")
    s.close()
    _emit(out)


CHILDREN = {
    "overhead": lambda a: child_overhead(int(a[0])),
    "torch_overhead": lambda a: child_torch_overhead(int(a[0])),
    "fabric": lambda a: child_fabric(int(a[0])),
    "export": lambda a: child_export(*map(int, a)),
    "import_write": lambda a: child_import_write(*map(int, a)),
    "import_hidden": lambda a: child_import_hidden(*map(int, a)),
}


# ---------------------------------------------------------------------------
# Parent checks
# ---------------------------------------------------------------------------
class Checks:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []
        self.data: dict = {}

    def run(self, name: str, fn, required: bool = True):
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


def check_fabric(c: Checks, ordinal: int) -> str:
    r = _run_child(["fabric", ordinal])
    c.data.setdefault("fabric", {})[ordinal] = r
    print(json.dumps(r, indent=2))
    if not r.get("ok"):
        raise RuntimeError(r.get("error") or r.get("stderr_tail"))
    if r["posix_fd"].get("export_fd") != "ok":
        raise RuntimeError(f"POSIX-fd export failed: {r['posix_fd']}")
    return f"auto handle type: {r['auto_handle_type']}; fabric alone: {r['fabric']}"


def check_overhead(c: Checks, ordinal: int) -> str:
    r = _run_child(["overhead", ordinal])
    c.data.setdefault("overhead", {})[ordinal] = r
    print(json.dumps(r, indent=2))
    if not r.get("ok"):
        raise RuntimeError(r.get("error") or r.get("stderr_tail"))
    t = _run_child(["torch_overhead", ordinal])
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

    from a2ad.client.cuda_map import CudaMapping

    size, aux, rnd, seed = 8 * MiB + 123, 64 * 1024, 7, 3
    a, b = socket.socketpair()
    try:
        r = _run_child(["export", exp_ordinal, b.fileno(), size, aux, rnd, seed], pass_fds=[b.fileno()])
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
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "import_write", str(o), str(b.fileno()),
                   str(size), str(me), str(ep)]
            p = subprocess.Popen(cmd, pass_fds=[b.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
            res = None
            for line in out.splitlines():
                if line.startswith(RESULT_TAG):
                    res = json.loads(line[len(RESULT_TAG):])
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
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "import_hidden", "0", str(b.fileno()), str(2 * MiB)]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=cd.uuid_of(imp_ordinal))
        p = subprocess.Popen(cmd, pass_fds=[b.fileno()], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        b.close()
        socket.send_fds(a, [json.dumps({"row_stride": al.size}).encode()], [al.fd])
        a.settimeout(120)
        a.recv(1)
        out, err = p.communicate(timeout=120)
    finally:
        a.close()
        be.release(al)
    res = None
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
    if res is None:
        raise RuntimeError(f"child failed: {err[-2000:]}")
    print(json.dumps(res, indent=2))
    c.data["hidden_gpu_import"] = res
    if res["result"] != "mapped and wrote":
        raise RuntimeError(res["result"])
    return res["result"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write all measurements to this file")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        CHILDREN[args.child[0]](args.child[1:])
        return 0

    c = Checks()
    if not c.run("inventory", lambda: check_inventory(c)):
        _summary(c, args)
        return 1
    n = len(c.data["devices"])
    for o in range(n):
        c.run(f"handle types on GPU {o}", lambda o=o: check_fabric(c, o))
    for o in range(n):
        c.run(f"daemon context overhead on GPU {o}", lambda o=o: check_overhead(c, o))
    c.run("exporter exits, importer maps (same GPU)", lambda: check_exporter_exits(c, 0, 0))
    if n >= 2:
        c.run("exporter on GPU 0 exits, importer on GPU 1", lambda: check_exporter_exits(c, 0, 1))
        c.run("cross-GPU peer writes (2 GPUs)", lambda: check_cross_gpu(c, [0, 1]))
        if n > 2:
            c.run(f"cross-GPU peer writes ({n} GPUs)", lambda: check_cross_gpu(c, list(range(n))))
        c.run(
            "importer with CUDA_VISIBLE_DEVICES hiding the memory's GPU",
            lambda: check_hidden_gpu(c, 0, 1),
            required=False,
        )
    else:
        c.run("cross-GPU peer writes, 2 importers on one GPU", lambda: check_cross_gpu(c, [0, 0]))
        print("\n(only one GPU: cross-GPU checks skipped)")
    return _summary(c, args)


def _summary(c: Checks, args) -> int:
    print("\n================ summary ================")
    for status, name, detail in c.rows:
        print(f"{status:4}  {name}: {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checks": c.rows, "data": c.data}, f, indent=2, default=str)
        print(f"measurements written to {args.json}")
    return 1 if any(s == "FAIL" for s, _, _ in c.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
