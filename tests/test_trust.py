"""Which runtime folders and daemons a client trusts (a2ad.runtime.check_trusted, the fd.sock
probe's peer credentials), and the metrics port: a busy port named, idle connections that
cannot lock a scraper out.

The trust tests create folders and daemons owned by another uid, so they need root (CI runs
as root) and are skipped otherwise."""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import DaemonProcess, free_port

from a2ad import errors, runtime
from a2ad.connection import DaemonClient
from a2ad.tools.launcher import DaemonLauncher, LaunchError

OTHER_UID = OTHER_GID = 12345

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making files and daemons of another uid needs root")


@pytest.fixture
def scratch():
    """A private folder on the same short path as the runtime folders (sockets <= 107 bytes)."""
    import shutil

    d = Path(tempfile.mkdtemp(prefix="a2ad-tr-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def refused(rd, match: str, **kw) -> errors.PermissionDenied:
    with pytest.raises(errors.PermissionDenied, match=match) as ei:
        with DaemonClient(rd, timeout=2, **kw) as c:
            c.request("hello")
    return ei.value


# ------------------------------------------------------------------- the folder
@needs_root
def test_folder_owned_by_another_uid_is_refused(scratch, monkeypatch):
    monkeypatch.delenv(runtime.DAEMON_UID_ENV, raising=False)
    rd = scratch / "rt"
    rd.mkdir(mode=0o700)
    os.chown(rd, OTHER_UID, OTHER_GID)
    exc = refused(rd, "owned by uid 12345")
    msg = str(exc)
    assert str(rd) in msg and "0700" in msg and "--runtime-dir" in msg
    with pytest.raises(errors.PermissionDenied):
        runtime.check_trusted(rd)
    runtime.check_trusted(rd, extra_uids=[OTHER_UID])  # trusted on request
    monkeypatch.setenv(runtime.DAEMON_UID_ENV, str(OTHER_UID))
    runtime.check_trusted(rd)  # the daemon's uid, named by the environment


@needs_root
@pytest.mark.parametrize("mode", [0o770, 0o720, 0o702, 0o777, 0o1777, 0o1733])
def test_writable_by_others_is_refused_even_with_a_real_daemon(daemon, mode):
    rd = daemon.runtime_dir
    assert daemon.request("hello")["pid"] == daemon.pid
    os.chmod(rd, mode)
    try:
        # root-owned (these tests run as root) and sticky make no difference: anyone who may
        # write there may create the sockets first
        exc = refused(rd, f"mode {mode:04o}")
        assert str(rd) in str(exc) and "replace its sockets" in str(exc)
    finally:
        os.chmod(rd, 0o700)
    assert daemon.request("hello")["pid"] == daemon.pid


@needs_root
def test_folders_above_and_symlinks(scratch):
    # a world-writable parent without the sticky bit: anyone could swap the folder
    parent = scratch / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    (parent / "rt").mkdir(mode=0o700)
    with pytest.raises(errors.PermissionDenied, match="folder above it"):
        runtime.check_trusted(parent / "rt")
    os.chmod(parent, 0o1777)  # tmp-style parent: fine
    runtime.check_trusted(parent / "rt")
    # a symlink another user owns (and could re-point) on the way
    link = scratch / "link"
    os.symlink(parent / "rt", link)
    runtime.check_trusted(link)
    os.lchown(link, OTHER_UID, OTHER_GID)
    with pytest.raises(errors.PermissionDenied, match="symlink"):
        runtime.check_trusted(link)
    # not a folder
    (scratch / "file").write_text("")
    with pytest.raises(errors.PermissionDenied, match="not a folder"):
        runtime.check_trusted(scratch / "file")


def test_own_folder_and_own_daemon_work(daemon):
    with DaemonClient(daemon.runtime_dir) as c:
        assert c.request("hello")["pid"] == daemon.pid
        pid, uid, _ = c.daemon_cred
        assert pid == daemon.pid and uid == os.geteuid()
    runtime.check_trusted(daemon.runtime_dir)


def test_bad_daemon_uid_variable(daemon, monkeypatch):
    monkeypatch.setenv(runtime.DAEMON_UID_ENV, "a2ad")
    with pytest.raises(errors.InvalidField, match=runtime.DAEMON_UID_ENV):
        DaemonClient(daemon.runtime_dir).request("hello")


# -------------------------------------------------------- a daemon of another uid
# The interpreter may live where that uid cannot read (a home folder): start as root, import
# everything the daemon runs, then drop to the uid for good before serving.
_AS_OTHER = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    sys.path[0] = {root!r}
    import a2ad, a2ad.daemon, a2ad.tools.cli
    for m in pkgutil.walk_packages(a2ad.daemon.__path__, "a2ad.daemon."):
        importlib.import_module(m.name)
    import prometheus_client, prometheus_client.process_collector, logging.handlers, json, selectors
    os.setgroups([])
    os.setresgid({gid}, {gid}, {gid})
    os.setresuid({uid}, {uid}, {uid})
    sys.exit(a2ad.tools.cli.main(["serve", "--runtime-dir", {rd!r}, "--backend", "host", "--fd-store", "none",
                                  "--log-level", "debug"]))
""")


@pytest.fixture
def other_daemon(scratch):
    os.chmod(scratch, 0o755)  # that uid must reach its folder
    rd = scratch / "other"
    rd.mkdir(mode=0o700)
    os.chown(rd, OTHER_UID, OTHER_GID)
    root = str(Path(runtime.__file__).resolve().parent.parent)
    code = _AS_OTHER.format(root=root, uid=OTHER_UID, gid=OTHER_GID, rd=str(rd))
    d = DaemonLauncher(rd, argv=[sys.executable, "-c", code], trust_uids=[OTHER_UID])
    try:
        d.start(30)
        yield d
    finally:
        d.stop()


@needs_root
def test_daemon_of_another_uid_is_refused(other_daemon, scratch, monkeypatch):
    monkeypatch.delenv(runtime.DAEMON_UID_ENV, raising=False)
    rd = other_daemon.runtime_dir
    assert Path(f"/proc/{other_daemon.pid}").stat().st_uid == OTHER_UID
    # its own folder: refused for the folder's owner
    refused(rd, "owned by uid 12345")
    # the same daemon behind a folder we trust (root's, 0700, its sockets linked in): refused
    # by the listening process's credentials
    trusted = scratch / "trusted"
    trusted.mkdir(mode=0o700)
    for name in (runtime.CTL_SOCK, runtime.FD_SOCK):
        os.link(rd / name, trusted / name)
    assert stat.S_ISSOCK(os.stat(trusted / runtime.FD_SOCK).st_mode)
    exc = refused(trusted, "runs as uid 12345")
    assert exc.details["pid"] == other_daemon.pid and exc.details["uid"] == OTHER_UID
    # once that uid is named as the daemon's, both ways in work
    monkeypatch.setenv(runtime.DAEMON_UID_ENV, str(OTHER_UID))
    for where in (rd, trusted):
        with DaemonClient(where, timeout=5) as c:
            assert c.request("hello")["pid"] == other_daemon.pid
            assert c.daemon_cred[1] == OTHER_UID


# ---------------------------------------------------------------------- metrics
def _scrape(port: int, timeout: float) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        return r.read().decode()


def test_busy_metrics_port_is_named(runtime_dir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        d = DaemonProcess(runtime_dir, "--backend", "host", "--metrics-port", str(port))
        try:
            with pytest.raises(LaunchError) as ei:
                d.start()
        finally:
            d.stop()
        assert f"127.0.0.1:{port}" in str(ei.value) and "in use" in str(ei.value), str(ei.value)


def test_idle_connections_cannot_block_a_scrape(runtime_dir):
    port = free_port()
    d = DaemonProcess(runtime_dir, "--backend", "host", "--metrics-port", str(port))
    idle: list[socket.socket] = []
    try:
        d.start()
        assert "a2ad_up" in _scrape(port, 5)
        for _ in range(40):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)  # let the daemon accept them all
        for i in range(3):
            t0 = time.monotonic()
            text = _scrape(port, 2)
            took = time.monotonic() - t0
            print(f"\nscrape {i} with 40 idle connections open: {took * 1e3:.0f} ms")
            assert "a2ad_up" in text and took < 2.0
        # ctl keeps working too, and the oldest idle connections were the ones let go
        assert d.request("hello")["pid"] == d.pid
        idle[0].settimeout(2)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()
        d.stop()
