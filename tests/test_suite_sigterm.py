"""The test suite's own hygiene: a test run ended by SIGTERM (a CI timeout, ``timeout``, a kill)
tears its fixtures down as Ctrl-C does, so the daemon a test started does not outlive it; a
child that a test forked still dies of SIGTERM as it would without the suite's handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

HOLDER = '''
import os, time

def test_hold(daemon):
    with open(os.environ["A2AD_HOLD_MARK"], "w") as f:
        f.write(f"{daemon.pid} {daemon.runtime_dir}\\n")
    time.sleep(120)
'''

FORKER = '''
import os, signal, time

def test_forked_child_dies_of_sigterm():
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(60)
        finally:
            os._exit(7)  # reached only if the signal were turned into an exception
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
'''


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line holds ``text``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if text.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            pass
    return out


def _pytest(tmp_path: Path, name: str, body: str, env: dict) -> subprocess.Popen:
    (tmp_path / name).write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", name],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_to_the_run_stops_the_daemon_of_the_running_test(tmp_path):
    mark = tmp_path / "mark"
    run = _pytest(tmp_path, "test_holder.py", HOLDER, {"A2AD_HOLD_MARK": str(mark)})
    runtime_dir = None
    try:
        end = time.monotonic() + 60
        while not mark.exists() or not mark.read_text().endswith("\n"):
            assert run.poll() is None, f"the inner run ended early:\n{run.communicate()[0]}"
            assert time.monotonic() < end, "the inner test's daemon did not start within 60 s"
            time.sleep(0.1)
        pid_text, runtime_dir = mark.read_text().split()
        daemon_pid = int(pid_text)
        assert daemon_pid in _pids_naming(runtime_dir)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 2, out  # pytest's "interrupted"
        assert "KeyboardInterrupt" in out and "terminated by signal 15" in out, out
        assert _pids_naming(runtime_dir) == [], f"processes of the inner test's daemon outlived the run:\n{out}"
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate(timeout=30)
        for pid in _pids_naming(runtime_dir) if runtime_dir else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_forked_child_still_dies_of_sigterm(tmp_path):
    run = _pytest(tmp_path, "test_forker.py", FORKER, {})
    try:
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate(timeout=30)
    assert run.returncode == 0, out
    assert "1 passed" in out, out
