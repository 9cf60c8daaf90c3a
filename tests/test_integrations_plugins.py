"""The engine plugins' switch, version checks and entry points (no engine needed; the tests
that drive the engines' own code are scripts/test-engines.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_plugins_do_nothing_unless_switched_on(monkeypatch, engine):
    import importlib

    monkeypatch.delenv("A2AD_ENGINE_PLUGIN", raising=False)
    mod = importlib.import_module(f"a2ad.integrations.{engine}")
    before = set(sys.modules)
    mod.register()
    assert not {m for m in set(sys.modules) - before if m == engine or m.startswith(engine + ".")}
    for off in ("0", "", "no"):
        monkeypatch.setenv("A2AD_ENGINE_PLUGIN", off)
        mod.register()
    monkeypatch.setenv("A2AD_ENGINE_PLUGIN", "1")
    try:
        importlib.import_module(engine)
    except ImportError:
        with pytest.raises(RuntimeError, match=f"{engine} is not installed"):
            mod.register()


@pytest.mark.parametrize("engine,inside,outside", [
    ("vllm", ["0.33.0", "0.33.1", "0.33.0rc2"], ["0.32.9", "0.34.0", "1.0.0"]),
    ("sglang", ["0.5.23", "0.5.23.post1"], ["0.5.22", "0.5.24", "0.6.0"]),
])
def test_versions_outside_the_tested_range_are_refused_naming_both(engine, inside, outside):
    import importlib

    mod = importlib.import_module(f"a2ad.integrations.{engine}")
    for v in inside:
        assert mod.check_version(v) == v
    lo, hi = mod.VLLM_TESTED if engine == "vllm" else mod.SGLANG_TESTED
    for v in outside:
        with pytest.raises(RuntimeError) as exc:
            mod.check_version(v)
        msg = str(exc.value)
        assert f"{engine} {v}" in msg and f">={lo},<{hi}" in msg and "A2AD_ENGINE_PLUGIN" in msg, msg


def test_entry_points_and_extras_are_declared():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]
    assert eps["vllm.general_plugins"]["a2ad"] == "a2ad.integrations.vllm:register"
    assert eps["sglang.srt.plugins"]["a2ad"] == "a2ad.integrations.sglang:register"
    extras = meta["project"]["optional-dependencies"]
    from a2ad.integrations import sglang, vllm

    assert extras["vllm"] == [f"vllm>={vllm.VLLM_TESTED[0]},<{vllm.VLLM_TESTED[1]}"]
    assert extras["sglang"] == [f"sglang>={sglang.SGLANG_TESTED[0]},<{sglang.SGLANG_TESTED[1]}"]
    assert "a2ad.integrations" in meta["tool"]["setuptools"]["packages"]


def test_deep_ep_switch_serves_import_deep_ep_from_a2ad(monkeypatch):
    """A2AD_DEEP_EP=1 with the plugins on: ``import deep_ep`` (and the engines' find_spec probe)
    gives a2ad.deep_ep; either switch off: nothing happens."""
    import importlib
    import importlib.util

    import a2ad.deep_ep
    from a2ad import integrations

    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    for plugins, deep in (("", "1"), ("1", ""), ("1", "0"), ("0", "1")):
        monkeypatch.setenv("A2AD_ENGINE_PLUGIN", plugins)
        monkeypatch.setenv("A2AD_DEEP_EP", deep)
        assert integrations.install_deep_ep() is False and "deep_ep" not in sys.modules
    monkeypatch.setenv("A2AD_ENGINE_PLUGIN", "1")
    monkeypatch.setenv("A2AD_DEEP_EP", "1")
    assert integrations.install_deep_ep() is True
    assert integrations.install_deep_ep() is True  # idempotent
    import deep_ep

    assert deep_ep is a2ad.deep_ep and importlib.import_module("deep_ep") is a2ad.deep_ep
    assert importlib.util.find_spec("deep_ep") is not None
    from deep_ep import Buffer, Config  # what SGLang's dispatcher module imports

    assert Buffer is a2ad.deep_ep.Buffer and Config is a2ad.deep_ep.Config


def test_deep_ep_switch_reaches_engine_modules_imported_before_it(monkeypatch):
    """An engine module that probed or imported deep_ep before the plugin loaded: SGLang's
    dispatcher module gets Buffer/Config bound (as its import would have), vLLM's cached
    has_deep_ep probe forgets its answer."""
    import functools
    import importlib.util
    import types

    import a2ad.deep_ep
    from a2ad.integrations import sglang as sgl_plugin, vllm as vllm_plugin

    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.setenv("A2AD_ENGINE_PLUGIN", "1")
    monkeypatch.setenv("A2AD_DEEP_EP", "1")
    sgl = types.ModuleType(sgl_plugin.DEEPEP_MODULE)
    sgl.use_deepep, sgl._deepep_import_error = False, ImportError("No module named 'deep_ep'")
    monkeypatch.setitem(sys.modules, sgl_plugin.DEEPEP_MODULE, sgl)

    @functools.cache
    def _has_module(name):
        return importlib.util.find_spec(name) is not None

    iu = types.ModuleType("vllm.utils.import_utils")
    iu._has_module = _has_module
    monkeypatch.setitem(sys.modules, "vllm.utils.import_utils", iu)
    assert _has_module("deep_ep") is False  # probed before the plugin
    assert vllm_plugin.install_deep_ep_ll() is True
    assert _has_module("deep_ep") is True
    assert sgl_plugin.install_deep_ep_ll() is True
    assert sgl.use_deepep is True and sgl._deepep_import_error is None
    assert sgl.Buffer is a2ad.deep_ep.Buffer and sgl.Config is a2ad.deep_ep.Config
    assert hasattr(sgl, "sglang_per_token_group_quant_fp8")
