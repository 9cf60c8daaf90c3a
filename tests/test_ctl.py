"""a2ad-ctl: fast and torch-free, global options anywhere, JSON errors, --version, shutdown,
upgrade failures, a stale socket reported at once; the launcher runs the real a2ad whatever
the current folder holds."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import REPO, DaemonProcess

import a2ad
from a2ad import errors, runtime
from a2ad.tools.launcher import DaemonLauncher


def ctl_command() -> list[str]:
    """The installed `a2ad-ctl` script (what a user runs), else the module."""
    for cand in (Path(sys.executable).parent / "a2ad-ctl", shutil.which("a2ad-ctl")):
        if cand and Path(cand).is_file():
            return [str(cand)]
    return [sys.executable, "-m", "a2ad.tools.ctl"]


def ctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "a2ad.tools.ctl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


# ------------------------------------------------------------------ speed, imports
def test_ctl_and_connection_import_no_torch(daemon):
    code = textwrap.dedent(f"""
        import sys
        import a2ad.connection, a2ad.tools.ctl
        assert a2ad.tools.ctl.main(["--runtime-dir", {str(daemon.runtime_dir)!r}, "ping"]) == 0
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "prometheus_client"))
        print("HEAVY", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


@pytest.mark.full
def test_ping_wall_time(daemon):
    cmd = ctl_command() + ["--runtime-dir", str(daemon.runtime_dir), "ping"]
    subprocess.run(cmd, capture_output=True, timeout=60)  # warm the page cache
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        times.append(time.perf_counter() - t0)
        assert out.returncode == 0 and f"pid {daemon.pid}" in out.stdout, out.stdout + out.stderr
    med = statistics.median(times)
    print(f"\n`{' '.join(cmd[:1])} ping` wall time: median {med * 1e3:.0f} ms, "
          f"min {min(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms over {len(times)} runs")
    assert med < 0.3, f"a2ad-ctl ping median {med:.3f} s (want < 0.3 s): {times}"


# -------------------------------------------------------------------- stale socket
def test_stale_socket_reported_at_once(runtime_dir):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "1").start()
    try:
        d.kill9()
        assert (runtime_dir / runtime.CTL_SOCK).exists()  # left behind, as after a crash
        t0 = time.perf_counter()
        out = ctl("--runtime-dir", str(runtime_dir), "ping")
        wall = time.perf_counter() - t0
        print(f"\nping on a stale socket: {wall * 1e3:.0f} ms, exit {out.returncode}")
        assert out.returncode == 3, out.stdout + out.stderr
        assert "stale" in out.stderr and "no daemon is listening" in out.stderr and "a2ad serve" in out.stderr
        assert wall < 1.0, f"took {wall:.2f} s"
        # in-process too: no ZeroMQ wait at all
        from a2ad.connection import DaemonClient

        t0 = time.perf_counter()
        with pytest.raises(errors.DaemonUnavailable, match="stale") as ei:
            DaemonClient(runtime_dir, timeout=10).request("hello")
        assert time.perf_counter() - t0 < 0.5
        assert ei.value.details.get("stale") is True
    finally:
        d.stop()


def test_probe_once_per_client(daemon, monkeypatch):
    from a2ad import connection

    calls = []
    real = runtime.probe_daemon
    monkeypatch.setattr(runtime, "probe_daemon", lambda *a, **k: calls.append(1) or real(*a, **k))
    with connection.DaemonClient(daemon.runtime_dir) as c:
        for _ in range(5):
            c.request("hello")
        assert c.daemon_cred[0] == daemon.pid and c.daemon_cred[1] == os.geteuid()
    assert len(calls) == 1


# ------------------------------------------------------------------ options, JSON
def test_global_options_anywhere(daemon):
    rd = str(daemon.runtime_dir)
    for args in (
        ["--runtime-dir", rd, "--json", "status"],
        ["status", "--json", "--runtime-dir", rd],
        ["--runtime-dir", rd, "status", "--json", "--timeout", "3"],
        ["--json", "ping", "--runtime-dir", rd],
    ):
        out = ctl(*args)
        assert out.returncode == 0, (args, out.stdout + out.stderr)
        assert json.loads(out.stdout)["pid"] == daemon.pid, args
    out = ctl("jobs", "--runtime-dir", rd)
    assert out.returncode == 0 and out.stdout.strip() == "no jobs"


def test_errors_as_json(daemon, tmp_path):
    rd = str(daemon.runtime_dir)
    # the daemon's error: exit 1, one JSON document on stdout, nothing on stderr
    out = ctl("job", "nope", "--json", "--runtime-dir", rd)
    assert out.returncode == 1 and out.stderr == "", out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and doc["code"] == "no_such_job" and "nope" in doc["message"] and doc["exit_code"] == 1
    # unreachable: exit 3
    out = ctl("--json", "ping", "--runtime-dir", str(tmp_path / "none"))
    doc = json.loads(out.stdout)
    assert out.returncode == 3 and doc["code"] == "daemon_unavailable" and doc["exit_code"] == 3
    # usage: exit 2, JSON too
    for args in (["--json", "bogus"], ["job", "--json"], ["ping", "--timeout", "soon", "--json"]):
        out = ctl(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        doc = json.loads(out.stdout)
        assert doc["code"] == "usage" and doc["message"] and out.stderr == "", args
    # and without --json: human text on stderr
    out = ctl("job", "nope", "--runtime-dir", rd)
    assert out.returncode == 1 and out.stdout == "" and "no_such_job" in out.stderr
    out = ctl("bogus")
    assert out.returncode == 2 and "usage:" in out.stderr


def test_version():
    out = subprocess.run(ctl_command() + ["--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"a2ad-ctl {a2ad.__version__}"


# ------------------------------------------------------------------------ shutdown
@pytest.mark.parametrize("free_jobs", [False, True])
def test_shutdown(runtime_dir, free_jobs):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--grace", "30", "--fd-store", "none").start()
    try:
        args = ["shutdown", "--runtime-dir", str(runtime_dir), "--json"] + (["--free-jobs"] if free_jobs else [])
        out = ctl(*args)
        assert out.returncode == 0, out.stdout + out.stderr + d.log_tail()
        doc = json.loads(out.stdout)
        assert doc["pid"] == d.pid and doc["free_jobs"] is free_jobs and doc["stopped"] is True
        assert d.proc.wait(15) == 0, d.log_tail()
        out = ctl("ping", "--runtime-dir", str(runtime_dir))
        assert out.returncode == 3
    finally:
        d.stop()


def test_shutdown_human_text(runtime_dir):
    d = DaemonProcess(runtime_dir, "--backend", "host", "--fd-store", "none").start()
    try:
        out = ctl("--runtime-dir", str(runtime_dir), "shutdown")
        assert out.returncode == 0 and f"daemon pid {d.pid} stopped" in out.stdout, out.stdout + out.stderr
        assert d.proc.wait(15) == 0
    finally:
        d.stop()


# ------------------------------------------------------------------------- upgrade
class _FakeClient:
    """Stands in for DaemonClient: the old daemon answers hello, then refuses the upgrade."""

    def __init__(self, runtime_dir=None, timeout=5.0, **kw):
        self.runtime_dir, self.timeout = runtime_dir, timeout

    def request(self, rtype, wait=None, **fields):
        if rtype == "hello":
            return {"pid": 4242, "version": "0.1.0", "backend": "host", "uptime_s": 1.0}
        if rtype == "upgrade":
            raise errors.InternalError("the successor exited with 1 before taking over: boom")
        raise AssertionError(rtype)

    def close(self):
        pass


def test_upgrade_failure_says_old_daemon_kept(monkeypatch, capsys):
    from a2ad import connection
    from a2ad.tools import ctl as ctl_mod

    monkeypatch.setattr(connection, "DaemonClient", _FakeClient)
    assert ctl_mod.main(["upgrade", "--runtime-dir", "/nowhere"]) == 1
    err = capsys.readouterr().err
    assert "upgrade failed" in err and "boom" in err and "old daemon (pid 4242" in err and "stayed in charge" in err
    assert ctl_mod.main(["upgrade", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["code"] == "internal" and doc["details"]["old_daemon_kept"] is True and doc["details"]["old_pid"] == 4242


# ------------------------------------------------------- the real a2ad, whatever cwd
def test_launcher_runs_the_real_package_from_a_folder_with_a_fake_one(tmp_path, runtime_dir):
    fake = tmp_path / "cwd"
    (fake / "a2ad" / "tools").mkdir(parents=True)
    (fake / "a2ad" / "__init__.py").write_text("raise SystemExit('the fake a2ad was imported')\n__version__ = 'fake'\n")
    (fake / "a2ad" / "tools" / "__init__.py").write_text("")
    (fake / "a2ad" / "tools" / "cli.py").write_text("raise SystemExit(42)\n")
    # python_command itself
    out = subprocess.run(runtime.python_command("a2ad.tools.ctl", "--version"), cwd=str(fake),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"a2ad-ctl {a2ad.__version__}", out.stdout + out.stderr
    # and a daemon started from there
    d = DaemonLauncher(runtime_dir, "--backend", "host", cwd=str(fake))
    try:
        hello = d.start(30).hello
        assert hello["version"] == a2ad.__version__ and hello["pid"] == d.pid
        log_dir = d.log_path.parent
        assert log_dir.exists()
    finally:
        assert d.stop() == 0
    assert not log_dir.exists(), "the launcher left its log folder behind"


def test_launcher_error_carries_log_tail_and_cleans_up(runtime_dir):
    d = DaemonLauncher(runtime_dir, "--backend", "nonsense")
    with pytest.raises(RuntimeError, match="exited with 2") as ei:
        d.start(30)
    assert "invalid choice" in str(ei.value)
    assert not d.running() and not d.log_path.parent.exists()
