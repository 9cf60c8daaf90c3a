"""The daemon's core (a2ad/daemon/core/) decides and does nothing else: it imports no module
that does I/O or runs concurrently, and reads no clock or randomness of its own (time comes
with every event; tokens come from the Host port)."""

from __future__ import annotations

import ast
from pathlib import Path

import a2ad.daemon.core as core

FORBIDDEN_MODULES = {"zmq", "socket", "selectors", "subprocess", "threading", "asyncio", "os", "time", "secrets",
                     "random", "mmap", "fcntl", "signal", "multiprocessing"}


def _core_files() -> list[Path]:
    files = sorted(Path(core.__file__).parent.glob("*.py"))
    assert len(files) >= 8, files  # the package is where it is said to be
    return files


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_the_core_imports_nothing_that_does_io_or_reads_a_clock():
    bad = []
    for path in _core_files():
        tree = ast.parse(path.read_text(), str(path))
        for line, mod in _imports(tree):
            top = mod.split(".")[0]
            if top in FORBIDDEN_MODULES:
                bad.append(f"{path.name}:{line} imports {mod}")
            if mod.startswith("a2ad.daemon.") and not mod.startswith(("a2ad.daemon.core", "a2ad.daemon.backends.base",
                                                                        "a2ad.daemon.auth", "a2ad.daemon.persist",
                                                                        "a2ad.daemon.domain")):
                bad.append(f"{path.name}:{line} imports the daemon's adapter {mod}")
    assert not bad, "\n".join(bad)


def test_the_core_reads_no_clock():
    bad = []
    for path in _core_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(w in code for w in ("monotonic(", "time.time(", "perf_counter(", "datetime.now(", "os.pidfd_open",
                                       "os.close(", "gethostname(")):
                bad.append(f"{path.name}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_domain_module_is_imported_for_types_only():
    """federation.py names the domain bus's class for its annotations; importing it would bring
    zmq into the core."""
    path = Path(core.__file__).parent / "federation.py"
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "a2ad.daemon.domain":
            raise AssertionError(f"federation.py:{node.lineno} imports a2ad.daemon.domain at run time")
