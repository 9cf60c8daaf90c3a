"""The examples in examples/ run as users run them: no arguments, host backend, their own daemon.

Every program at the top of examples/ is an example: it runs with no arguments and ends in
``<name>: OK`` (``python examples/*.py`` runs them all). Programs that only serve an example
live in examples/helpers/ and are named by one. Each runs as a subprocess in its own process
group from a temp cwd, with a timeout; whatever happens, the group is killed afterwards, so no
daemon, keeper or rank outlives the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    env.pop("A2AD_RUNTIME_DIR", None)  # start their own daemon
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # ops_restart.sh's trap cleans up on TERM
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{argv[-1]} did not finish within {timeout} s; output:\n{out}")
    finally:
        try:  # anything of the group still there (a daemon, a keeper, a rank)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def last_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else ""


#: The programs at the top of examples/ (data files such as domain.toml are not programs).
PROGRAMS = sorted(p.name for p in EXAMPLES.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))
PYTHON_EXAMPLES = ["moe_layer.py", "switch_from_flashinfer.py"]
SHELL_EXAMPLES = ["ops_restart.sh"]


def test_every_program_in_examples_is_an_example_or_a_named_helper():
    """A new program at the top of examples/ must be run by this file with no arguments (or be
    moved to examples/helpers/); every helper must be used by an example."""
    assert PROGRAMS == sorted(PYTHON_EXAMPLES + SHELL_EXAMPLES), (
        f"examples/ holds {PROGRAMS}: every program there must run with no arguments and be run by "
        "tests/test_examples.py, or live in examples/helpers/")
    texts = "\n".join((EXAMPLES / p).read_text() for p in PROGRAMS)
    helpers = sorted(p for p in (EXAMPLES / "helpers").iterdir() if p.is_file() and p.suffix == ".py"
                     and p.name != "__init__.py")
    assert helpers, "examples/helpers/ is empty: remove the folder"
    for h in helpers:
        assert f"helpers/{h.name}" in texts or f"helpers.{h.stem} import" in texts, \
            f"examples/helpers/{h.name} is used by no example"
        assert "helper" in h.read_text()[:600].lower(), f"examples/helpers/{h.name}: its docstring must say it is a helper"


@pytest.mark.parametrize("script", PYTHON_EXAMPLES)
def test_python_example(script, tmp_path):
    res = run_example([sys.executable, str(EXAMPLES / script)], tmp_path, timeout=60)
    name = script[:-3]
    assert res.returncode == 0, res.stdout
    assert last_line(res.stdout) == f"{name}: OK", res.stdout
    assert "MISMATCH" not in res.stdout
    assert "stopped the daemon" in res.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.full
@pytest.mark.parametrize("script", SHELL_EXAMPLES)
def test_ops_restart(script, tmp_path):
    assert script == "ops_restart.sh"
    res = run_example(["bash", str(EXAMPLES / "ops_restart.sh")], tmp_path, timeout=90)
    out = res.stdout
    assert res.returncode == 0, out
    assert last_line(out) == "ops_restart: OK", out
    assert "upgraded: pid" in out
    assert "PeerLost" in out and "recovered in" in out and "generation 1" in out
