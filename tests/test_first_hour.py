"""A new user's first hour, followed literally: the README's two commands from a clean clone,
``--help`` of every entry point (quick, and without importing torch, where it needs none), and
the README's claims that code can check (install path, error list, expert split).

The clone is a ``git clone`` of this repository (its committed state) into the test's temp
folder; the commands run there with ``A2AD_PYTHON`` set to a venv made for the test, so that the
editable install ``scripts/setup.sh`` makes goes into that venv and nowhere else. The venv sees
the packages of the interpreter running the tests (torch, pyzmq, ...; helpers.make_venv, which
works from inside a venv too): a venv with nothing in it would download torch, which is what
README.md's CPU path does and what the timings in the test's output are not about.
Timings are printed as ``figure: ...`` lines (``pytest -s`` shows them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import make_venv

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
#: README.md with its line breaks as spaces: the claims below hold however the text is wrapped.
README_FLAT = " ".join(README.split())

#: --help of a command that needs no torch answers within this (seconds), scaled up by the load
#: of the machine (at most 3x) since a busy 2-core machine slows every process start.
HELP_BOUND_S = 1.0


def load_factor() -> float:
    try:
        return max(1.0, min(3.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    except OSError:
        return 1.0


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "A2AD_RUNTIME_DIR", "A2AD_CSRC", "A2AD_SETUP_FORCE", "PYTHONSAFEPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.update(extra)
    return env


def run(cmd, cwd, timeout, **env) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=str(cwd), env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:  # a daemon or rank of the command still there
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: nothing to clone")
    dst = tmp_path_factory.mktemp("first-hour") / "a2ad"
    r = subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dst)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dst


@pytest.fixture(scope="module")
def venv(clone, tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("first-hour-venv"), pip=True)


@pytest.fixture(scope="module")
def demo(clone, venv):
    """``bash scripts/demo.sh`` (small, so the test is quick): set-up into the venv, then the demo."""
    res, took = run(["bash", "scripts/demo.sh", "--ranks", "2", "--rounds", "3", "--tokens", "32", "--hidden", "128"],
                    clone, timeout=600, A2AD_PYTHON=str(venv))
    print(f"\nfigure: first 'bash scripts/demo.sh --ranks 2 --rounds 3 --tokens 32 --hidden 128' from a clean clone "
          f"(set-up into an empty venv included): {took:.1f} s")
    return res, took


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(900)
def test_demo_from_a_clean_clone(clone, venv, demo):
    res, _ = demo
    out, err = res.stdout, res.stderr
    assert res.returncode == 0, out[-3000:] + err[-3000:]
    # set-up: what it installs, each slow step announced
    assert "[a2ad setup] installing a2ad from this checkout (editable)" in err, err
    assert re.search(r"\[a2ad setup\] a2ad \S+ installed \(\d+ s\)", err), err
    # the demo: says what it starts, reports while ranks start, then its rounds
    for line in ("a2ad demo: starting a daemon on", "a2ad demo: starting 2 ranks",
                 "a2ad demo: every rank imported torch", "a2ad demo: every rank attached"):
        assert line in out, out
    assert out.index("a2ad demo: starting 2 ranks") < out.index("round  tokens"), out
    assert "summary: 3/3 rounds matched the reference" in out and out.rstrip().endswith("a2ad demo: OK"), out
    # the editable install is the clone's, in the venv
    r = subprocess.run([str(venv), "-c", "import a2ad.client, os; print(os.path.realpath(a2ad.client.__file__))"],
                       cwd="/", capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.stdout.strip() == str((clone / "client" / "__init__.py").resolve()), r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(900)
def test_test_command_from_the_clone_skips_the_set_up_once_done(clone, venv, demo):
    """``bash scripts/test.sh`` (a subset: the whole suite would run this test again): the set-up
    sees the clone installed already and installs nothing; every test file collects in the clone."""
    assert demo[0].returncode == 0, "the demo's set-up failed (see test_demo_from_a_clean_clone)"
    t0 = time.monotonic()
    r, _ = run(["bash", "scripts/setup.sh"], clone, timeout=120, A2AD_PYTHON=str(venv))
    setup_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "nothing to install" in r.stderr and "pip" not in r.stderr.replace("nothing to install", ""), r.stderr
    print(f"\nfigure: scripts/setup.sh when the checkout is installed already: {setup_s:.2f} s")
    assert setup_s < 5.0 * load_factor(), f"the installed check took {setup_s:.1f} s"
    sub = "test_layout or test_every_program_in_examples"
    res, took = run(["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", "-k", sub], clone, timeout=600,
                    A2AD_PYTHON=str(venv))
    print(f"figure: 'bash scripts/test.sh -q -k \"{sub}\"' from the clone (collects the whole suite): {took:.1f} s")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "nothing to install" in res.stderr, res.stderr
    m = re.search(r"(\d+) passed", res.stdout)
    assert m and int(m.group(1)) >= 10 and "error" not in res.stdout.lower(), res.stdout[-3000:]


# ------------------------------------------------------------------------------------------ --help
#: Entry points whose --help needs no torch: (label, argv after the Python interpreter).
NO_TORCH_HELP = [
    ("a2ad --help", ["-m", "a2ad", "--help"]),
    ("a2ad serve --help", ["-m", "a2ad", "serve", "--help"]),
    ("a2ad demo --help", ["-m", "a2ad", "demo", "--help"]),
    ("a2ad build-ext --help", ["-m", "a2ad", "build-ext", "--help"]),
    ("a2ad-ctl --help", ["-m", "a2ad.tools.ctl", "--help"]),
    ("a2ad-ctl drain --help", ["-m", "a2ad.tools.ctl", "drain", "--help"]),
    ("a2ad-bench --help", ["-m", "a2ad.bench", "--help"]),
]
#: What each entry point is in pyproject.toml, so that the list above covers them all.
SCRIPTS = {"a2ad": "a2ad.tools.cli:main", "a2ad-ctl": "a2ad.tools.ctl:main", "a2ad-bench": "a2ad.bench:main"}

PROBE = """
import runpy, sys
sys.argv = [sys.argv[1]] + sys.argv[2:]
mod = sys.argv[0]
try:
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH", code, file=sys.stderr)
"""


def best_of(n: int, cmd, cwd, **env) -> tuple[float, subprocess.CompletedProcess]:
    best, last = float("inf"), None
    for _ in range(n):
        last, took = run(cmd, cwd, timeout=120, **env)
        best = min(best, took)
    return best, last


def test_entry_points_are_all_covered():
    text = (REPO / "pyproject.toml").read_text()
    block = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    declared = dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', block, re.M))
    assert declared == SCRIPTS, declared
    labels = {label.split()[0] for label, _ in NO_TORCH_HELP}
    assert labels == set(SCRIPTS), labels


@pytest.mark.parametrize("label,argv", NO_TORCH_HELP, ids=[label for label, _ in NO_TORCH_HELP])
def test_help_is_quick_and_imports_no_torch(label, argv, tmp_path):
    """The help of every entry point needs no torch: it must not import it (checked in the
    process), and answers within HELP_BOUND_S (best of 3, scaled by the machine's load)."""
    py = [sys.executable]
    probe, _ = run(py + ["-c", PROBE] + argv[1:], tmp_path, timeout=120, PYTHONPATH=str(REPO))
    assert probe.returncode == 0 and "usage:" in probe.stdout, probe.stdout + probe.stderr
    assert probe.stderr.strip().splitlines()[-1] == "NO-TORCH 0", f"{label} imported torch:\n{probe.stderr}"
    took, res = best_of(3, py + argv, tmp_path, PYTHONPATH=str(REPO))
    bound = HELP_BOUND_S * load_factor()
    print(f"\nfigure: {label}: {took:.3f} s (best of 3; bound {bound:.2f} s)")
    assert res.returncode == 0 and "usage:" in res.stdout, res.stdout + res.stderr
    assert took < bound, f"{label} took {took:.2f} s (bound {bound:.2f} s)"


def test_demo_script_help_is_quick_without_set_up(tmp_path):
    """``bash scripts/demo.sh --help`` answers from the checkout without the set-up (no pip, no torch)."""
    took, res = best_of(3, ["bash", str(REPO / "scripts" / "demo.sh"), "--help"], tmp_path,
                        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    bound = HELP_BOUND_S * load_factor()
    print(f"\nfigure: bash scripts/demo.sh --help: {took:.3f} s (best of 3; bound {bound:.2f} s)")
    assert res.returncode == 0 and "usage: a2ad demo" in res.stdout and "--ranks" in res.stdout, res.stdout + res.stderr
    assert "[a2ad setup]" not in res.stderr, res.stderr
    assert took < bound, f"bash scripts/demo.sh --help took {took:.2f} s (bound {bound:.2f} s)"


PROBE_SCRIPT = """
import runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH", code, file=sys.stderr)
"""


@pytest.mark.parametrize("script", ["moe_layer.py", "switch_from_flashinfer.py", "helpers/ops_worker.py"])
def test_example_help_is_quick_and_imports_no_torch(script, tmp_path):
    """Every Python example (and helper program) parses its options before it imports torch."""
    path = REPO / "examples" / script
    probe, _ = run([sys.executable, "-c", PROBE_SCRIPT, path, "--help"], tmp_path, timeout=120, PYTHONPATH=str(REPO))
    assert probe.returncode == 0 and "usage:" in probe.stdout, probe.stdout + probe.stderr
    assert probe.stderr.strip().splitlines()[-1] == "NO-TORCH 0", f"{script} --help imported torch:\n{probe.stderr}"
    took, res = best_of(3, [sys.executable, path, "--help"], tmp_path, PYTHONPATH=str(REPO))
    bound = HELP_BOUND_S * load_factor()
    print(f"\nfigure: python examples/{script} --help: {took:.3f} s (best of 3; bound {bound:.2f} s)")
    assert res.returncode == 0 and "usage:" in res.stdout, res.stdout + res.stderr
    assert took < bound, f"examples/{script} --help took {took:.2f} s (bound {bound:.2f} s)"


def test_help_texts_say_what_options_do_and_their_defaults(tmp_path):
    def help_of(*argv):
        r, _ = run([sys.executable, *argv, "--help"], tmp_path, timeout=60, PYTHONPATH=str(REPO))
        assert r.returncode == 0, r.stderr
        return " ".join(r.stdout.split())

    serve = help_of("-m", "a2ad", "serve")
    assert "Run the a2ad daemon in the foreground" in serve
    assert re.search(r"--log-level \{debug,info,warning,error\} \S.*\(default info", serve), serve
    drain = help_of("-m", "a2ad.tools.ctl", "drain")
    assert re.search(r"--off \S.*accept new jobs again", drain), drain
    bench = help_of("-m", "a2ad.bench")
    for opt, default in (("--top-k TOP_K", "default 8"), ("--num-experts NUM_EXPERTS", "default 256"),
                         ("--seed SEED", "default 1234")):
        m = re.search(re.escape(opt) + r" (.*?)(?= --|$)", bench)
        assert m and default in m.group(1), (opt, m and m.group(1))


# ------------------------------------------------------------------------------------------ claims
def test_readme_install_path_matches_the_scripts_and_pyproject():
    """The CPU path of README.md (CPU torch first, the version the scripts install), the scripts
    and pyproject.toml agree; no install command names a distribution that is not published."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    m = re.search(r"^TORCH_VERSION=(\S+)", setup, re.M)
    assert m, "scripts/setup.sh has no TORCH_VERSION"
    version = m.group(1)
    assert f"pip install torch=={version} --index-url <PyTorch's CPU wheel index>" in README_FLAT
    assert f"torch {version}" in README_FLAT
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    deps = re.search(r"dependencies = \[(.*?)\n\]", (REPO / "pyproject.toml").read_text(), re.S).group(1)
    torch_req = Requirement(re.search(r'"(torch[^"]*)"', deps).group(1))
    assert torch_req.specifier.contains(version), (torch_req, version)
    assert "pyproject.toml accepts any torch >= 2.4" in README_FLAT and str(torch_req.specifier) == ">=2.4"
    assert "pip install a2ad" not in README_FLAT and "'a2ad[" not in README_FLAT  # not on the package index
    assert "not on the Python package index" in README_FLAT and "pip wheel --no-deps -w dist ." in README_FLAT


def test_readme_wheel_command_makes_the_wheel_it_names(tmp_path):
    """``pip wheel --no-deps -w dist .`` from a copy of the package files gives the
    ``a2ad-<version>-py3-none-any.whl`` README.md names."""
    import a2ad

    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "a2ad", "client", "csrc"):
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, symlinks=False, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info", "client", "_csrc") if name == "a2ad" else shutil.ignore_patterns(
                "__pycache__", "*.egg-info"))
        elif p.is_file():
            src.mkdir(exist_ok=True)
            shutil.copy2(p, src / name)
    r, took = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."],
                  src, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    print(f"\nfigure: pip wheel --no-deps -w dist . : {took:.1f} s")
    assert sorted(p.name for p in (src / "dist").iterdir()) == [f"a2ad-{a2ad.__version__}-py3-none-any.whl"]
    assert "dist/a2ad-<version>-py3-none-any.whl" in README_FLAT


def test_readme_error_list_is_complete_and_importable():
    import a2ad.client as client
    from a2ad import errors

    section = README_FLAT.split("Every failure is a subclass of `a2ad.client.A2ADError`:", 1)[1].split("No call waits", 1)[0]
    listed = set(re.findall(r"`([A-Z]\w+)`", section))
    for name in ("Draining", "JobDestroyed", "NoSuchJob", "PeerLeft", "BackendError", "PeerLost", "PeerTimeout",
                 "DaemonUnavailable", "RendezvousTimeout", "SpecMismatch", "RankTaken", "LimitExceeded",
                 "PermissionDenied", "StateError", "InputError"):
        assert name in listed, f"README's error list omits {name}"
    for name in listed:
        cls = getattr(client, name, None)
        assert cls is not None and name in client.__all__, f"{name} is not exported from a2ad.client"
        assert issubclass(cls, errors.A2ADError), name
    assert client.Draining is errors.Draining


def test_readme_expert_split_is_the_one_routed_by():
    from a2ad.layout import experts_of_rank

    assert [len(experts_of_rank(r, 10, 4)) for r in range(4)] == [3, 3, 2, 2]
    assert [list(experts_of_rank(r, 10, 4))[0] for r in range(4)] == [0, 3, 6, 8]
    assert "10 experts over 4 ranks are 3/3/2/2" in README_FLAT
    assert "rank 0 owns experts 0-2, rank 1 3-5, rank 2 6-7, rank 3 8-9" in README_FLAT


def test_docs_point_at_nothing_a_user_lacks():
    """The docs name only what is in the repository (or installable); the comments name
    FlashInfer's MoeAlltoAll, not a private name for it."""
    texts = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
                                       REPO / "benchmarks" / "README.md"]}
    for p, text in texts.items():
        for bad in (".peers/", "$OUT", "shared/peers", "SEED_API", "a2ad/client/"):
            assert bad not in text, f"{p.relative_to(REPO)} names {bad!r}"
    for p in [REPO / "a2ad" / "layout.py", REPO / "a2ad" / "protocol.py", REPO / "client" / "moe_alltoall.py"]:
        text = p.read_text()
        assert not re.search(r"\bthe seed\b|seed's|seed API|SEED_API", text, re.I), p.name
    bench = texts[REPO / "benchmarks" / "README.md"]
    assert "pip install flashinfer-python==0.7.2.post1" in bench
    assert re.search(r"^a2ad-bench .*--write-perf-doc docs/PERF.md", bench, re.M)
