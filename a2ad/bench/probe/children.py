"""The probe's child processes: each body runs in a fresh ``python -m a2ad.bench.probe.children
NAME ARGS...`` and reports one ``RESULT {json}`` line on stdout; :func:`run_child` starts one
and reads that line back.

The bodies that act as the daemon (``overhead``, ``fabric``, ``export``) go through the driver
API alone and never import torch themselves; the importers and ``torch_overhead`` import it
where they need it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from a2ad import cuda_driver as cd

MiB = 1 << 20
RESULT_TAG = "RESULT "
MODULE = "a2ad.bench.probe.children"


def _emit(obj) -> None:
    print(RESULT_TAG + json.dumps(obj), flush=True)


def parse_result(stdout: str) -> dict | None:
    """The last ``RESULT`` line of a child's stdout, decoded; None when there is none."""
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    return result


def child_command(name: str, *args) -> list[str]:
    """The command line that runs the child body ``name`` with ``args``."""
    return [sys.executable, "-m", MODULE, name, *map(str, args)]


def child_env(env_extra: dict | None = None) -> dict:
    """This process's environment plus ``env_extra``; from a source checkout, with the checkout
    first on PYTHONPATH so that a child imports the same a2ad as this process."""
    import a2ad

    env = dict(os.environ)
    root = Path(a2ad.__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.update(env_extra or {})
    return env


def run_child(args: list, env_extra: dict | None = None, pass_fds=(), timeout=120) -> dict:
    """Run one child body (``args``: its name, then its arguments) to the end; its result, with
    ``returncode`` added (and ``stderr_tail`` when it failed)."""
    p = subprocess.run(child_command(*args), env=child_env(env_extra), pass_fds=pass_fds, capture_output=True,
                       text=True, timeout=timeout)
    result = parse_result(p.stdout)
    if result is None:
        result = {"ok": False, "error": f"child exited {p.returncode} without a result"}
    if p.returncode != 0 or not result.get("ok", True):
        result.setdefault("stderr_tail", p.stderr[-3000:])
    result["returncode"] = p.returncode
    return result


def _as_the_daemon() -> None:
    """A daemon-like body measures and allocates through the driver API alone, as the
    daemon does: torch is not even imported in this process."""
    assert "torch" not in sys.modules, "torch was imported in a daemon-like child"


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


def _pattern(seed: int, n: int) -> bytes:
    """``n`` bytes that depend on ``seed`` only: what the exporter writes and the importer expects."""
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


def _client_package() -> None:
    """Make ``a2ad.client`` importable (a checkout that was not pip-installed), or say why not."""
    from a2ad.bench.common import ensure_client_package

    why = ensure_client_package()
    if why:
        raise RuntimeError(why)


# ---------------------------------------------------------------------------
# The bodies
# ---------------------------------------------------------------------------
def child_overhead(ordinal: int) -> None:
    """As the daemon (no torch): what the CUDA context costs, and what the daemon holds
    between setups with the default (transient) and the kept context policy."""
    _as_the_daemon()
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
    _as_the_daemon()
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


def child_export(ordinal: int, sock_fd: int, size: int, aux: int, flag_round: int, pattern_seed: int) -> None:
    """Exporter (as the daemon, no torch): allocate + initialize, write a pattern after the aux
    region through a temporary mapping, send the fd over SCM_RIGHTS, then exit without waiting."""
    _as_the_daemon()
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

    _client_package()
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

    _client_package()
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in CHILDREN:
        print(f"usage: python -m {MODULE} {{{','.join(CHILDREN)}}} ARGS...", file=sys.stderr)
        return 2
    CHILDREN[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
