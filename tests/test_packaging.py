"""Packaging: the wheel and sdist carry the CUDA sources and py.typed, an installed (not
editable) a2ad finds its sources and reports one version everywhere, the shipped kernels
compile, and missing optional tools fail with a clear reason.

The wheel is built from a copy of the package files in a temp folder (not in the checkout,
which others may be editing) and installed into a fresh venv that sees the torch, pyzmq and
msgpack of the interpreter running the tests (helpers.make_venv: a .pth file lists that
interpreter's site-packages, so this works from inside a venv too, where
--system-site-packages would reach the base interpreter instead); its python runs outside the
checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import make_venv
from test_csrc_compiles import TORCH_NVCC_FLAGS

REPO = Path(__file__).resolve().parent.parent
from a2ad.client._ext import HEADERS, SOURCES  # noqa: E402

CSRC_FILES = SOURCES + HEADERS
#: what the build needs from the checkout
BUILD_INPUTS = ("pyproject.toml", "README.md", "MANIFEST.in", "a2ad", "client", "csrc")


def source_version() -> str:
    text = (REPO / "a2ad" / "__init__.py").read_text()
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    assert m, "a2ad/__init__.py has no __version__ string"
    return m.group(1)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "A2AD_CSRC", "PYTHONSAFEPATH")}
    env.update(extra)
    return env


def run(cmd, cwd, timeout=240, **env):
    return subprocess.run([str(c) for c in cmd], cwd=str(cwd), capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env))


@pytest.fixture(scope="module")
def src_copy(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        elif p.is_file():
            shutil.copy2(p, dst / name)
    return dst


@pytest.fixture(scope="module")
def wheel(src_copy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
             "--disable-pip-version-check", "-q", "-w", out], cwd=src_copy)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(out.glob("a2ad-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; torch etc. come from the interpreter running the
    tests (helpers.make_venv)."""
    root = tmp_path_factory.mktemp("venv")
    py = make_venv(root, pip=False)
    # the running interpreter's pip (seen through the venv's .pth) installs into the venv;
    # --ignore-installed: an a2ad installed in the running interpreter must not count
    r = run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
             "--disable-pip-version-check", "-q", wheel], cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working folder outside the checkout, so the checkout is not on sys.path."""
    return tmp_path_factory.mktemp("elsewhere")


def test_wheel_carries_sources_types_and_client(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in CSRC_FILES:
        assert f"a2ad/_csrc/{f}" in names, sorted(names)
    assert "a2ad/py.typed" in names
    assert "a2ad/client/__init__.py" in names and "a2ad/client/_ext.py" in names
    assert "a2ad/tools/cli.py" in names
    assert not any(n.startswith(("csrc/", "client/", "tests/")) for n in names), sorted(names)
    meta = zipfile.ZipFile(wheel).read(f"a2ad-{source_version()}.dist-info/METADATA").decode()
    assert f"Version: {source_version()}" in meta.splitlines()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any(re.match(r"Requires-Dist: numpy\b", line) for line in requires), requires
    assert any("matplotlib" in line and 'extra == "bench"' in line for line in requires), requires


def test_sdist_carries_sources(src_copy, tmp_path):
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = run([sys.executable, "-c", code, tmp_path], cwd=src_copy)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import tarfile

    name = r.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as tar:
        names = set(tar.getnames())
    top = name.removesuffix(".tar.gz")
    for f in CSRC_FILES:
        assert f"{top}/csrc/{f}" in names, sorted(names)
    assert f"{top}/a2ad/py.typed" in names


def test_installed_package_finds_its_sources(venv, outside):
    code = (
        "import json, importlib.metadata as m, a2ad; from a2ad.client import _ext; "
        "print(json.dumps({'file': a2ad.__file__, 'csrc': str(_ext.csrc_dir()), 'version': a2ad.__version__, "
        "'meta': m.version('a2ad'), 'ext': _ext.__file__}))"
    )
    r = run([venv / "bin" / "python", "-c", code], cwd=outside)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = Path(got["file"]).resolve().parent
    assert site.is_relative_to(venv.resolve()), got  # the installed copy, not the checkout
    assert Path(got["ext"]).resolve().is_relative_to(venv.resolve()), got
    assert Path(got["csrc"]) == site / "_csrc", got
    assert all((Path(got["csrc"]) / f).is_file() for f in CSRC_FILES)
    assert got["version"] == got["meta"] == source_version()


def test_version_commands_agree(venv, outside):
    v = source_version()
    bin_ = venv / "bin"
    for cmd, prog in (([bin_ / "a2ad", "--version"], "a2ad"),
                      ([bin_ / "python", "-m", "a2ad", "--version"], "a2ad"),
                      ([bin_ / "a2ad-ctl", "--version"], "a2ad-ctl")):
        r = run(cmd, cwd=outside, timeout=60)
        assert r.returncode == 0, (cmd, r.stderr[-2000:])
        assert r.stdout.strip() == f"{prog} {v}", (cmd, r.stdout, r.stderr)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.timeout(300)
@pytest.mark.full
def test_installed_kernels_compile_for_sm90(venv, outside):
    """The one compile of this file: the installed package's copy of the kernels."""
    found = list(venv.glob("lib/python*/site-packages/a2ad/_csrc"))
    assert len(found) == 1, found
    kernels = [str(found[0] / n) for n in SOURCES if n.endswith(".cu")]
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", *TORCH_NVCC_FLAGS, "-c", *kernels]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=str(outside))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    for k in kernels:
        assert (outside / (Path(k).stem + ".o")).stat().st_size > 0, k


def _block_module(folder: Path, module: str) -> Path:
    """A sitecustomize that makes `module` look not installed (import raises ModuleNotFoundError)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f'''
import importlib.abc, importlib.machinery, sys
class _Block(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} or name.startswith({module + "."!r}):
            return importlib.machinery.ModuleSpec(name, self)
        return None
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}}", name=spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Block())
''')
    return folder


def test_bench_plot_without_matplotlib_fails_with_install_hint(venv, outside):
    block = _block_module(outside / "no-matplotlib", "matplotlib")
    png = outside / "x.png"
    r = run([venv / "bin" / "a2ad-bench", "--plot", png, "--dry-run", "--tokens", "1", "--budget", "30"],
            cwd=outside, timeout=120, PYTHONPATH=str(block))
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "pip install matplotlib for --plot" in r.stderr and "'.[bench]'" in r.stderr, r.stderr[-2000:]
    assert "matplotlib" in r.stderr
    assert not png.exists()


def test_build_ext_without_nvcc_says_why(venv, outside):
    no_cuda = outside / "no-cuda-home"
    no_cuda.mkdir(exist_ok=True)
    path = os.pathsep.join([str(venv / "bin")] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                                                   if d and not (Path(d) / "nvcc").exists()])
    r = run([venv / "bin" / "a2ad", "build-ext", "--arch", "sm_90,sm_100"], cwd=outside, timeout=120,
            PATH=path, CUDA_HOME=str(no_cuda), A2AD_EXT_DIR=str(outside / "ext-cache"))
    assert r.returncode != 0, r.stdout + r.stderr
    err = r.stderr
    assert "nvcc" in err and "CUDA toolkit" in err and "CUDA_HOME" in err, err
    assert "sm_90,sm_100" in r.stdout, r.stdout  # says what it was asked to build
    import torch

    if torch.version.cuda is None:
        assert "without CUDA" in err, err


def test_build_ext_with_cpu_torch_says_so(venv, outside):
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"this torch has CUDA {torch.version.cuda}")
    r = run([venv / "bin" / "a2ad", "build-ext"], cwd=outside, timeout=120, A2AD_EXT_DIR=str(outside / "ext-cache"))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "built without CUDA" in r.stderr and "CUDA build of torch" in r.stderr, r.stderr
    assert "about a minute" not in r.stdout + r.stderr  # nothing was started


def test_missing_python_headers_are_a_toolchain_problem(monkeypatch, tmp_path):
    """The extension is a Python module too: without Python.h the build cannot work, and says so."""
    import sysconfig

    from a2ad.client import _ext

    real = sysconfig.get_paths()
    if (Path(real["include"]) / "Python.h").is_file():
        assert not any("Python.h" in p for p in _ext.toolchain_problems())
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real, "include": str(tmp_path)})
    problems = [p for p in _ext.toolchain_problems() if "Python.h" in p]
    assert len(problems) == 1 and str(tmp_path) in problems[0] and "-dev" in problems[0], problems


def test_build_ext_with_an_nvcc_wrapper_says_to_set_cuda_home(venv, outside):
    """An nvcc on PATH that is a wrapper script (its folder's parent has no CUDA headers): with
    CUDA_HOME unset torch would guess that parent, and the build would stop on a missing
    cuda_runtime.h; build-ext says so first, and names the toolkit the wrapper runs."""
    toolkit = outside / "toolkit"
    (toolkit / "bin").mkdir(parents=True, exist_ok=True)
    (toolkit / "include").mkdir(exist_ok=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("/* stand-in */\n")
    real = toolkit / "bin" / "nvcc"
    real.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8'\n")
    real.chmod(0o755)
    wrap = outside / "wrapper" / "bin"
    wrap.mkdir(parents=True, exist_ok=True)
    (wrap / "nvcc").write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    (wrap / "nvcc").chmod(0o755)
    path = os.pathsep.join([str(venv / "bin"), str(wrap)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                                                               if d and not (Path(d) / "nvcc").exists()])
    env = {k: v for k, v in clean_env(PATH=path, A2AD_EXT_DIR=str(outside / "ext-cache")).items()
           if k not in ("CUDA_HOME", "CUDA_PATH")}
    r = subprocess.run([str(venv / "bin" / "a2ad"), "build-ext"], cwd=str(outside), capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode != 0, r.stdout + r.stderr
    err = r.stderr
    assert "CUDA_HOME is not set" in err and "include/cuda_runtime.h" in err, err
    assert f"guessed from the nvcc on PATH ({wrap / 'nvcc'}) as {wrap.parent}" in err, err
    assert f"CUDA_HOME={toolkit}" in err, err


def test_arch_selection(monkeypatch):
    from a2ad.client import _ext

    assert _ext.parse_arch("sm_100, 9.0,sm_90") == ["sm_90", "sm_100"]
    assert _ext.parse_arch("90a") == ["sm_90a"]
    with pytest.raises(ValueError):
        _ext.parse_arch("hopper")
    monkeypatch.setenv("A2AD_CUDA_ARCH", "sm_100,sm_90")
    assert _ext.cuda_archs() == ["sm_90", "sm_100"]
    assert _ext.cuda_archs("sm_120") == ["sm_120"]  # an explicit list wins over the environment
    monkeypatch.delenv("A2AD_CUDA_ARCH")
    monkeypatch.setattr(_ext, "visible_archs", lambda: [])
    assert _ext.cuda_archs() == [_ext.DEFAULT_ARCH] == ["sm_90"]
    flags = _ext.gencode_flags(["sm_90", "sm_100"])
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-gencode=arch=compute_100,code=sm_100" in flags


def test_cache_key_covers_the_arch_list_and_sources(tmp_path):
    from a2ad.client import _ext

    src = _ext.csrc_dir()
    assert _ext.build_hash(src, "sm_90") != _ext.build_hash(src, "sm_90,sm_100")
    copy = tmp_path / "csrc"
    shutil.copytree(src, copy)
    assert _ext.build_hash(copy, "sm_90") == _ext.build_hash(src, "sm_90")
    with open(copy / "dispatch.cu", "a") as f:
        f.write("\n// edited\n")
    assert _ext.build_hash(copy, "sm_90") != _ext.build_hash(src, "sm_90")


def test_csrc_override_and_missing_sources(monkeypatch, tmp_path):
    from a2ad import errors
    from a2ad.client import _ext

    monkeypatch.setenv("A2AD_CSRC", str(tmp_path))
    assert _ext.csrc_dir() == tmp_path.resolve()
    with pytest.raises(errors.BuildError, match="A2AD_CSRC"):
        _ext._build_and_load(["sm_90"], tmp_path / "cache")
