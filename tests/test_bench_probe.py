"""The GPU probe (``python -m a2ad.bench.probe``, a2ad/bench/probe/).

CPU tests: without a usable CUDA the probe stops at once with the reason on one line and
exit status 1 (and ``--json`` records it as the failed inventory check); the child-runner
launches ``python -m a2ad.bench.probe.children`` and reports a child that gives no result;
the check record's PASS/FAIL/WARN accounting and the summary's exit status; which checks
main() runs for one GPU and for several, and its exit status (with the checks stubbed); the
exporter's pattern; torch imported only inside the functions that need it. GPU test (``gpu`` marker):
the probe for real, every required check passing.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a2ad import cuda_driver as cd
from a2ad.bench.probe import checks as probe_checks
from a2ad.bench.probe import children, cli

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "a2ad" / "bench" / "probe"


def _probe(*args, timeout=60, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "a2ad.bench.probe", *map(str, args)], env=full_env,
                          cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


def _lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# without CUDA: one line, nonzero exit
# ---------------------------------------------------------------------------
def test_probe_without_a_driver_says_why_on_one_line(tmp_path):
    """A driver library that does not load (how the tests act out a machine without one)."""
    out = tmp_path / "p.json"
    r = _probe("--json", out, A2AD_LIBCUDA=str(tmp_path / "no-libcuda.so.1"))
    text = r.stdout + r.stderr
    assert r.returncode == 1, text
    assert "Traceback" not in text, text
    lines = _lines(r)
    assert len(lines) == 1, text
    assert lines[0].startswith("python -m a2ad.bench.probe: cannot probe: CUDA is unavailable"), text
    assert "no-libcuda.so.1" in lines[0] and "is the NVIDIA driver installed?" in lines[0], text
    res = json.loads(out.read_text())
    assert res["checks"] == [["FAIL", "inventory", lines[0].split("cannot probe: ", 1)[1]]]


def test_probe_here_without_cuda_names_the_reason(tmp_path):
    """As this machine is (no GPU, perhaps no cuda-bindings): the reason cuda_driver gives."""
    why = cd.unavailable()
    if why is None:
        pytest.skip("CUDA is usable here")
    out = tmp_path / "p.json"
    r = _probe("--json", out)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert "Traceback" not in text, text
    assert _lines(r) == [f"python -m a2ad.bench.probe: cannot probe: {' '.join(str(why).split())}"], text
    assert any(w in text for w in ("cuda-bindings", "driver", "device")), text
    res = json.loads(out.read_text())
    assert [row[:2] for row in res["checks"]] == [["FAIL", "inventory"]]


def test_unavailable_reason_is_one_line(monkeypatch):
    monkeypatch.setattr(cd, "unavailable", lambda: cd.CudaUnavailable("no\ndevice here", function="cuInit"))
    assert cli.unavailable_reason() == "CUDA is unavailable: no device here"

    def boom():
        raise RuntimeError("odd\nfailure")

    monkeypatch.setattr(cd, "unavailable", boom)
    assert cli.unavailable_reason() == "RuntimeError: odd failure"
    monkeypatch.setattr(cd, "unavailable", lambda: None)
    assert cli.unavailable_reason() is None


# ---------------------------------------------------------------------------
# the child-runner
# ---------------------------------------------------------------------------
def test_child_command_runs_the_children_module():
    cmd = children.child_command("export", 0, 5, 1024)
    assert cmd == [sys.executable, "-m", "a2ad.bench.probe.children", "export", "0", "5", "1024"]


def test_run_child_without_a_result_reports_the_exit_and_stderr():
    r = children.run_child(["no_such_child", 0], timeout=60)
    assert r["ok"] is False
    assert r["error"] == "child exited 2 without a result"
    assert r["returncode"] == 2
    assert "usage: python -m a2ad.bench.probe.children" in r["stderr_tail"]


def test_parse_result_takes_the_last_result_line():
    out = "noise\nRESULT {\"ok\": false}\nmore\nRESULT {\"ok\": true, \"n\": 2}\n"
    assert children.parse_result(out) == {"ok": True, "n": 2}
    assert children.parse_result("nothing here\n") is None


def test_pattern_is_deterministic_and_seeded():
    p = children._pattern(3, 4096)
    assert len(p) == 4096 and p == children._pattern(3, 4096)
    assert p[:4] == bytes([93, 100, 107, 114])  # (3*31 + 7*i) & 0xFF
    assert p[256:260] == bytes([(93 + 7 * i) & 0xFF for i in range(256, 260)])
    assert children._pattern(4, 4096) != p
    assert children._pattern(3, 0) == b""


# ---------------------------------------------------------------------------
# the record and the summary
# ---------------------------------------------------------------------------
def test_checks_record_pass_fail_warn(capsys):
    c = probe_checks.Checks()
    assert c.run("passes", lambda: "fine") is True
    assert c.run("passes quietly", lambda: None) is True
    assert not c.failed

    def bad():
        raise ValueError("broken")

    assert c.run("optional", bad, required=False) is False
    assert not c.failed
    assert c.run("required", bad) is False
    assert c.failed
    assert c.rows == [
        ("PASS", "passes", "fine"),
        ("PASS", "passes quietly", ""),
        ("WARN", "optional", "ValueError: broken"),
        ("FAIL", "required", "ValueError: broken"),
    ]
    out = capsys.readouterr()
    assert "=== passes" in out.out and "--- FAIL required" in out.out
    assert "Traceback" in out.err  # a failing check shows where it failed


def test_summary_exit_status_and_json(tmp_path, capsys):
    c = probe_checks.Checks()
    c.rows += [("PASS", "a", "ok"), ("WARN", "b", "optional failed")]
    c.data["devices"] = [{"ordinal": 0}]
    out = tmp_path / "p.json"
    assert cli.summary(c, str(out)) == 0
    text = capsys.readouterr().out
    assert "PASS  a: ok" in text and "WARN  b: optional failed" in text
    assert f"measurements written to {out}" in text
    assert json.loads(out.read_text()) == {"checks": [["PASS", "a", "ok"], ["WARN", "b", "optional failed"]],
                                           "data": {"devices": [{"ordinal": 0}]}}
    c.rows.append(("FAIL", "c", "RuntimeError: no"))
    assert cli.summary(c) == 1
    assert "FAIL  c: RuntimeError: no" in capsys.readouterr().out


def _stub_checks(monkeypatch, n_gpus: int, failing: tuple[str, ...] = ()):
    """main() with CUDA usable and every check replaced by one that records its call."""
    calls = []

    def stub(name):
        def check(c, *args):
            calls.append((name, *args))
            if name == "inventory":
                c.data["devices"] = [{"ordinal": i} for i in range(n_gpus)]
            if name in failing:
                raise RuntimeError(f"{name} broke")
            return f"{name} ok"
        return check

    monkeypatch.setattr(cli, "unavailable_reason", lambda: None)
    for name in ("inventory", "fabric", "overhead", "exporter_exits", "cross_gpu", "hidden_gpu"):
        monkeypatch.setattr(cli, f"check_{name}", stub(name))
    return calls


def test_main_runs_the_checks_for_one_gpu(monkeypatch, tmp_path, capsys):
    calls = _stub_checks(monkeypatch, 1)
    assert cli.main(["--json", str(tmp_path / "p.json")]) == 0
    assert calls == [("inventory",), ("fabric", 0), ("overhead", 0), ("exporter_exits", 0, 0), ("cross_gpu", [0, 0])]
    assert "(only one GPU: cross-GPU checks skipped)" in capsys.readouterr().out
    assert [row[0] for row in json.loads((tmp_path / "p.json").read_text())["checks"]] == ["PASS"] * 5


def test_main_runs_the_checks_for_three_gpus(monkeypatch):
    calls = _stub_checks(monkeypatch, 3)
    assert cli.main([]) == 0
    assert calls == [("inventory",), ("fabric", 0), ("fabric", 1), ("fabric", 2), ("overhead", 0), ("overhead", 1),
                     ("overhead", 2), ("exporter_exits", 0, 0), ("exporter_exits", 0, 1), ("cross_gpu", [0, 1]),
                     ("cross_gpu", [0, 1, 2]), ("hidden_gpu", 0, 1)]


def test_main_exit_status(monkeypatch, capsys):
    # the hidden-GPU import is optional: its failure warns
    _stub_checks(monkeypatch, 2, failing=("hidden_gpu",))
    assert cli.main([]) == 0
    assert "WARN  importer with CUDA_VISIBLE_DEVICES hiding the memory's GPU: RuntimeError: hidden_gpu broke" in (
        capsys.readouterr().out)
    _stub_checks(monkeypatch, 2, failing=("fabric",))
    assert cli.main([]) == 1
    # a failed inventory ends the run there
    calls = _stub_checks(monkeypatch, 2, failing=("inventory",))
    assert cli.main([]) == 1
    assert calls == [("inventory",)]
    assert "FAIL  inventory: RuntimeError: inventory broke" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# torch stays out of module level
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("module", sorted(p.name for p in PROBE.glob("*.py")))
def test_probe_imports_torch_only_where_needed(module):
    """The daemon-like children must not bring torch's CUDA in: no module of the probe imports
    torch (or the torch-importing client modules) at module level."""
    tree = ast.parse((PROBE / module).read_text())
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            assert not (name == "torch" or name.startswith(("torch.", "a2ad.client"))), (module, name)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_probe_on_gpu_passes(tmp_path):
    if cd.bindings_version() is None:
        pytest.skip("cuda-bindings is not installed (pip install cuda-bindings, or the cuda extra: pip install '.[cuda]')")
    out = tmp_path / "p.json"
    r = _probe("--json", out, timeout=560)
    text = r.stdout[-8000:] + r.stderr[-8000:]
    assert r.returncode == 0, text
    summary = r.stdout.split("================ summary ================", 1)[1]
    assert "PASS  inventory:" in summary, text
    assert "FAIL" not in summary, text
    res = json.loads(out.read_text())
    assert res["checks"] and all(status in ("PASS", "WARN") for status, _, _ in res["checks"]), res["checks"]
    assert res["data"]["devices"]
