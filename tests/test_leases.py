"""Leases with real processes: a real daemon, rank processes speaking the raw protocol over its
sockets, another uid, an upgrade. The same cases run in-process in test_core.py and under the
simulator's daemon world; these show them end to end."""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a2ad import errors
from a2ad.connection import DaemonClient
from helpers import REPO, DaemonProcess, reap_keeper, settled_fd_count, wait_for

SPEC = dict(max_num_tokens=8, top_k=2, num_experts=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64)
OTHER_UID = 12345

#: Joins JOB rank 0 of 1 through the raw protocol and takes its handles (fds and the lease
#: socket), prints its lease; then obeys stdin: "drop" closes the handles and the lease socket
#: (what a process whose handles never reached it holds: nothing), "join" joins again and takes
#: the handles, printing OK or the error's code and message; "bye" closes its ctl.sock connection.
RANK = r"""
import json, os, socket, sys
from a2ad import errors, fdpass
from a2ad.connection import DaemonClient
rt, job, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = DaemonClient(rt, timeout=30)
held = []
def attach():
    r = c.request("join", job=job, ep_rank=0, ep_size=1, spec=spec, pid=os.getpid(), device="host", timeout=10.0)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(c.fd_path))
    fdpass.send_frame(s, {"v": 1, "ticket": r["ticket"]})
    answer, fds = fdpass.recv_frame(s, timeout=10)
    assert answer["ok"], answer
    held.append((s, fds))
    return r["lease"]
print("LEASE", attach().hex(), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "drop":
        for s, fds in held:
            s.close()
            for fd in fds:
                os.close(fd)
        held.clear()
        print("DROPPED", flush=True)
    elif cmd == "bye":
        c.close()
        print("BYE", flush=True)
    elif cmd == "join":
        try:
            attach()
            print("OK", flush=True)
        except errors.A2ADError as exc:
            print("ERROR", exc.code, exc.message, flush=True)
"""


class Rank:
    def __init__(self, runtime_dir: Path, job: str):
        self.proc = subprocess.Popen([sys.executable, "-c", RANK, str(runtime_dir), job, json.dumps(SPEC)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        word, lease = self.line().split()
        assert word == "LEASE", (word, lease)
        self.lease = bytes.fromhex(lease)

    def line(self, timeout: float = 60.0) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"rank pid {self.proc.pid} said nothing in {timeout} s")
        out = self.proc.stdout.readline()
        if not out:
            raise AssertionError(f"rank pid {self.proc.pid} exited with {self.proc.wait(5)}")
        return out.strip()

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()


def _slot(d: DaemonProcess, job: str) -> dict:
    info = d.request("job_info", job=job)
    return info["ranks"][0]


def test_a_process_that_lost_its_handles_in_an_upgrade_joins_again(runtime_dir):
    """The successor of an upgrade holds the rank attached for a process that holds nothing of
    it (its handles never reached it, or it gave them up): its own next join replaces that
    attachment instead of being refused as held by its own pid."""
    d1 = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30").start()
    rank = None
    try:
        rank = Rank(runtime_dir, "churn")
        out = subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", "--runtime-dir", str(runtime_dir), "--json",
                              "upgrade"], capture_output=True, text=True, timeout=120, cwd=str(REPO))
        assert out.returncode == 0, out.stdout + out.stderr
        d1.proc.wait(15)
        assert rank.ask("drop") == "DROPPED"
        with DaemonClient(runtime_dir, timeout=10) as c:
            assert c.request("job_info", job="churn")["ranks"][0]["state"] == "attached"
        assert rank.ask("join") == "OK"
        with DaemonClient(runtime_dir, timeout=10) as c:
            r0 = c.request("job_info", job="churn")["ranks"][0]
        assert r0["state"] == "attached" and r0["pid"] == rank.proc.pid and r0["attaches"] == 2, r0
    finally:
        if rank is not None:
            rank.close()
        new = json.loads(out.stdout)["new_pid"] if "out" in locals() and out.returncode == 0 else None
        if new is not None:
            try:
                os.kill(new, 15)
                wait_for(lambda: not Path(f"/proc/{new}").exists() or
                         Path(f"/proc/{new}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 15,
                         "the upgraded daemon to stop")
            except ProcessLookupError:
                pass
        d1.stop()
        reap_keeper(runtime_dir)


def _nogroup() -> str | None:
    try:
        return grp.getgrgid(65534).gr_name
    except KeyError:
        return None


@pytest.mark.skipif(os.geteuid() != 0 or _nogroup() is None, reason="needs root (to run a second uid) and group 65534")
def test_another_uids_copy_of_a_lease_token_is_refused(runtime_dir):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--group", _nogroup(), "--allow-uid", str(OTHER_UID)).start()
    rank = None
    try:
        rank = Rank(runtime_dir, "mine")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child, as the other uid
            code = 1
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(OTHER_UID)
                c = DaemonClient(runtime_dir, timeout=10)
                out = {}
                for rtype, extra in (("leave", {}), ("recover", {"timeout": 1.0})):
                    try:
                        c.request(rtype, job="mine", ep_rank=0, lease=rank.lease, **extra)
                        out[rtype] = "obeyed"
                    except errors.A2ADError as exc:
                        out[rtype] = f"{exc.code}: {exc.message}"
                os.write(w, json.dumps(out).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            out = json.loads(f.read() or "{}")
        os.waitpid(pid, 0)
        assert out.get("leave", "").startswith("permission_denied") and f"uid {OTHER_UID} may not leave" in out["leave"], out
        assert out.get("recover", "").startswith("permission_denied"), out
        assert _slot(d, "mine")["state"] == "attached"
    finally:
        if rank is not None:
            rank.close()
        d.stop()


def test_the_per_uid_fd_count_is_what_the_daemon_holds(runtime_dir):
    """A one-rank job costs the daemon its control block (the memfd and the description its
    mapping keeps), the row and the lease socket: the per-uid cap counts all of them."""
    d = DaemonProcess(runtime_dir, "--backend", "host").start()
    rank = None
    try:
        before = settled_fd_count(d.pid)
        rank = Rank(runtime_dir, "count")
        assert rank.ask("bye") == "BYE"  # its ctl.sock connection is a connection, not the job's
        held = settled_fd_count(d.pid) - before
        with DaemonClient(runtime_dir, timeout=10) as c:  # (this request's connection is not counted)
            usage = c.request("status")["uid_usage"]
        assert held == 4 and usage["fds"] == held, (held, usage)
    finally:
        if rank is not None:
            rank.close()
        d.stop()
