"""Shared fixtures: a real daemon process per test, GPU markers skipped centrally."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import DaemonProcess  # noqa: E402


_PYTEST_PID = os.getpid()


def _terminated(signum, frame):
    """SIGTERM in the pytest process: end the run as Ctrl-C does (pytest then tears every
    fixture down, so the daemons and processes the tests started end with it; by default the
    signal would kill pytest at once and leave them running). A second SIGTERM kills at once. In
    a child that a test forked, the signal does what it does by default, as if no handler had
    been inherited."""
    signal.signal(signum, signal.SIG_DFL)
    if os.getpid() != _PYTEST_PID:
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread() and os.getpid() == _PYTEST_PID:
        signal.signal(signal.SIGTERM, _terminated)
        _load_modules_eagerly_here()


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


#: CUDA's module loading setting, and whether whoever ran pytest set it (then it stays theirs)
MODULE_LOADING = "CUDA_MODULE_LOADING"
MODULE_LOADING_SET_BY_CALLER = MODULE_LOADING in os.environ


def _load_modules_eagerly_here() -> None:
    """CUDA initialized in this process with eager module loading, unless the caller set
    ``CUDA_MODULE_LOADING``. Several ranks of one job run in this process (the kernel tests'
    jobs) and wait for each other inside their kernels. Under CUDA's default lazy loading the
    first launch of a kernel loads it, and a load may wait for the kernels already running
    (docs/DEEPEP.md: a harness of in-process ranks timed out that way): a rank's first torch
    op after its dispatch would wait for that dispatch, which waits for a rank not launched
    yet. Eagerly, every kernel is loaded when the context is made. (It is not all a first
    launch can do: a staging test that queued a rank's first bf16 -> float conversion between
    two ranks' dispatches still timed out under eager loading, when it ran first in its process;
    it now queues every rank's dispatch before any rank's torch ops, as run_round does.) The
    driver takes the setting when it initializes, here
    (tests/test_cuda_kernels.py::test_this_process_loads_kernels_eagerly asks it), so it leaves
    the environment again: the processes the tests start, one rank each, keep the default."""
    if MODULE_LOADING_SET_BY_CALLER:
        return
    os.environ[MODULE_LOADING] = "EAGER"
    try:
        _cuda_count()  # initializes CUDA, where there is a GPU
    finally:
        del os.environ[MODULE_LOADING]


#: set to 1 (or pass --full) to run the full tier: the tests marked ``full`` too
FULL_ENV = "A2AD_TEST_FULL"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help=f"run the full tier: also the tests marked 'full' (long real-process runs), which "
                          f"are deselected otherwise; {FULL_ENV}=1 does the same")


def full_tier(config) -> bool:
    return bool(config.getoption("--full")) or os.environ.get(FULL_ENV, "") not in ("", "0")


def _named_files(config) -> set[Path]:
    """The test files named on the command line (``tests/test_x.py`` or one of its node ids),
    as opposed to folders: a file asked for by name runs whole, its ``full`` tests included."""
    out = set()
    for arg in config.args:
        p = Path(config.invocation_params.dir, arg.split("::", 1)[0])
        if p.is_file():
            out.add(p.resolve())
    return out


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_gpu2 = pytest.mark.skip(reason=f"needs 2 CUDA GPUs ({n} visible)")
    for item in items:
        if "gpu2" in item.keywords and n < 2:
            item.add_marker(skip_gpu2)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
    # the fast tier: the tests marked full are deselected (pytest reports them as deselected,
    # never as passed) unless the full tier was asked for or their file was named
    if full_tier(config):
        return
    named = _named_files(config)
    keep, drop = [], []
    for item in items:
        long_run = item.get_closest_marker("full") is not None and Path(str(item.path)).resolve() not in named
        (drop if long_run else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        config.stash[_FULL_LEFT_OUT] = len(drop)


_FULL_LEFT_OUT = pytest.StashKey[int]()


def pytest_report_header(config):
    if full_tier(config):
        return "a2ad test tier: full (every test, the long real-process runs marked 'full' included)"
    return (f"a2ad test tier: fast (the tests marked 'full' are deselected; --full or {FULL_ENV}=1 runs them, "
            f"and so does naming their file)")


def pytest_terminal_summary(terminalreporter, config):
    left = config.stash.get(_FULL_LEFT_OUT, 0)
    if left:
        terminalreporter.write_line(f"a2ad: fast tier: {left} test(s) marked 'full' deselected, not run "
                                    f"(bash scripts/test.sh --full runs them)")


@pytest.fixture
def runtime_dir(tmp_path_factory) -> Path:
    # short path: AF_UNIX socket paths are limited to 107 bytes
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="a2ad-t-"))
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(runtime_dir):
    """A real `a2ad serve --backend host` on a private runtime folder (grace 1 s); stopped
    after the test whatever its outcome (a start that fails stops its own daemon)."""
    d = DaemonProcess(runtime_dir, "--backend", os.environ.get("A2AD_TEST_BACKEND", "host"), "--grace", "1")
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def daemon_factory(runtime_dir):
    """Start a daemon with custom arguments: daemon_factory('--grace', '5'). Every daemon it
    started is stopped after the test, even when stopping another one fails."""
    started = []

    def make(*args, backend="host"):
        d = DaemonProcess(runtime_dir, "--backend", backend, *args)
        started.append(d)
        d.start()
        return d

    yield make
    problems = []
    for d in started:
        try:
            d.stop()
        except Exception as exc:  # stop the rest first, then report
            problems.append(exc)
    if problems:
        raise problems[0]
