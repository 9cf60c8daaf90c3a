"""Every example answers ``--help`` at once (README: "answers --help at once"), and
ops_restart.sh stops waiting as soon as a process it waits on exits early instead of waiting out
its TIMEOUT. Each runs as a subprocess in its own process group, killed afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_examples import EXAMPLES, PROGRAMS, last_line


def _run(argv, cwd, env_extra, timeout):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    env.update(env_extra)
    env.pop("A2AD_RUNTIME_DIR", None)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{argv} did not finish within {timeout} s; output:\n{out}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - t0


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_example_answers_help_at_once(program, tmp_path):
    """``--help`` prints a usage and exits 0 without running anything (no daemon, no step)."""
    path = EXAMPLES / program
    argv = ["bash", str(path), "--help"] if program.endswith(".sh") else [sys.executable, str(path), "--help"]
    rc, out, _ = _run(argv, tmp_path, {}, timeout=60)
    assert rc == 0, out
    assert out.lower().startswith("usage:"), out
    ran = [line for line in out.splitlines() if "step 1" in line or line.rstrip().endswith((": OK", ": FAIL"))]
    assert not ran, f"{program} --help ran the example ({ran}):\n{out}"


def test_ops_restart_refuses_unknown_arguments(tmp_path):
    rc, out, _ = _run(["bash", str(EXAMPLES / "ops_restart.sh"), "--rounds", "3"], tmp_path, {}, timeout=60)
    assert rc == 2 and "unknown argument --rounds" in out and "step 1" not in out, out


def test_ops_restart_stops_at_once_when_its_daemon_exits_early(tmp_path):
    """The daemon the example starts exits at once (here: the real CLI given an option it does
    not know). The example fails naming it and its status, long before its TIMEOUT."""
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'for a in "$@"; do [ "$a" = serve ] && exec {sys.executable} -m a2ad.tools.cli serve --no-such-option; done\n'
        f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    timeout = 120
    rc, out, took = _run(["bash", str(EXAMPLES / "ops_restart.sh")], cwd, {"PYTHON": str(wrapper),
                                                                          "TIMEOUT": str(timeout),
                                                                          "TMPDIR": str(tmp_path)}, timeout=300)
    assert rc != 0 and last_line(out) == "ops_restart: FAIL", out
    assert "the daemon (pid" in out and "exited early (status 2)" in out, out
    assert "unrecognized arguments: --no-such-option" in out, out  # the daemon's log is shown
    assert took < timeout / 2, f"the example took {took:.1f} s to notice (TIMEOUT {timeout} s):\n{out}"
    work = Path(out.split(" on ", 1)[1].split()[0]).parent  # "step 1: start a daemon ... on WORK/run"
    assert work.parent == tmp_path and not work.exists(), f"{work} was left behind"
