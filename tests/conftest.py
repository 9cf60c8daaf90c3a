"""Shared fixtures: a real daemon process per test, GPU markers skipped centrally."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import DaemonProcess  # noqa: E402


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_gpu2 = pytest.mark.skip(reason=f"needs 2 CUDA GPUs ({n} visible)")
    for item in items:
        if "gpu2" in item.keywords and n < 2:
            item.add_marker(skip_gpu2)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)


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
