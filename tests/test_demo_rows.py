"""The demo prints one row per round as the rounds complete (README). What held the rows back
was the parent importing torch at the first row (seconds) while the ranks ran on, so that the
rows came all at once: the parent computes the round plan without torch, and on the host
backend never imports it. Checked on a real run (daemon, rank processes) without a wall-clock
bound: the parent's modules at the end, and the rows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from helpers import REPO


def test_demo_parent_needs_no_torch_to_print_its_rows(tmp_path):
    code = textwrap.dedent("""
        import argparse, sys
        from a2ad.tools import demo

        p = argparse.ArgumentParser()
        demo.add_arguments(p)
        rc = demo.run(p.parse_args(sys.argv[1:]))
        print("PARENT_IMPORTED_TORCH", "torch" in sys.modules, flush=True)
        sys.exit(rc)
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("A2AD_RUNTIME_DIR", None)
    r = subprocess.run([sys.executable, "-c", code, "--ranks", "2", "--rounds", "4", "--tokens", "8", "--hidden", "16",
                        "--backend", "host", "--runtime-dir", str(tmp_path / "run"), "--timeout", "30"],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    out = r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr}"
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("round"))
    rows = lines[head + 1: head + 5]
    assert [row.split()[0] for row in rows] == ["1", "2", "3", "4"] and all(row.endswith("ok") for row in rows), out
    assert lines[head + 5].startswith("summary: 4/4 rounds matched"), out
    assert "PARENT_IMPORTED_TORCH False" in out, f"the demo's parent imported torch:\n{out}"
