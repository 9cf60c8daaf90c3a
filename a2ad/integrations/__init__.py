"""Serving-engine integrations: a ``flashinfer.moe_ep`` communication backed by a2ad
(:mod:`a2ad.integrations.flashinfer`) and the vLLM and SGLang plugins
(:mod:`a2ad.integrations.vllm`, :mod:`a2ad.integrations.sglang`), which an engine loads
through its plugin entry point and which act only when ``A2AD_ENGINE_PLUGIN=1``
(docs/ENGINES.md). With ``A2AD_DEEP_EP=1`` as well, the plugins also make ``import deep_ep``
give :mod:`a2ad.deep_ep` in the engine's processes (:func:`install_deep_ep`), so that the
engines' DeepEP low-latency paths run on a2ad."""

import logging
import os
import sys

#: The one switch that turns the engine plugins on (off by default).
SWITCH = "A2AD_ENGINE_PLUGIN"
#: With the plugins on, also serve the engines' ``import deep_ep`` from :mod:`a2ad.deep_ep`.
DEEP_EP_SWITCH = "A2AD_DEEP_EP"

_ON = ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether ``A2AD_ENGINE_PLUGIN`` is set to 1 (or true/yes/on)."""
    return os.environ.get(SWITCH, "").strip().lower() in _ON


def deep_ep_enabled() -> bool:
    """Whether the plugins are on and ``A2AD_DEEP_EP`` is set to 1 (or true/yes/on)."""
    return enabled() and os.environ.get(DEEP_EP_SWITCH, "").strip().lower() in _ON


def install_deep_ep() -> bool:
    """Make ``deep_ep`` name :mod:`a2ad.deep_ep` in this process (``sys.modules``), so that an
    engine's ``import deep_ep`` / ``from deep_ep import Buffer`` and its ``find_spec("deep_ep")``
    probe get a2ad's drop-in, a DeepEP installed alongside or not. Acts only when
    :func:`deep_ep_enabled`; returns whether ``deep_ep`` is a2ad's now. Idempotent."""
    if not deep_ep_enabled():
        return False
    import a2ad.deep_ep as mod

    previous = sys.modules.get("deep_ep")
    if previous is not mod:
        if previous is not None:
            logging.getLogger("a2ad.integrations").warning(
                "a2ad: deep_ep was already imported (%s) before %s=1 took effect; later imports get a2ad.deep_ep",
                getattr(previous, "__file__", previous), DEEP_EP_SWITCH)
        sys.modules["deep_ep"] = mod
    return True


def version_tuple(v: str) -> tuple:
    """The leading numeric release parts of a version string: "0.33.0rc1" -> (0, 33, 0)."""
    import re

    m = re.match(r"\d+(?:\.\d+)*", v.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def check_version(engine: str, tested: tuple[str, str], version: str | None = None) -> str:
    """Raise RuntimeError when ``version`` (default: the installed distribution ``engine``'s)
    lies outside ``tested`` = [low, high), naming both versions; return it otherwise."""
    if version is None:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        try:
            version = dist_version(engine)
        except PackageNotFoundError:
            raise RuntimeError(f"a2ad's {engine} plugin is enabled ({SWITCH}=1) but {engine} is not installed") from None
    lo, hi = tested
    if not version_tuple(lo) <= version_tuple(version) < version_tuple(hi):
        raise RuntimeError(
            f"a2ad's {engine} plugin is tested with {engine} >={lo},<{hi}; this is {engine} "
            f"{version}. Install a tested {engine} (a2ad's '{engine}' extra names it: pip install '.[{engine}]' "
            f"in a2ad's checkout) or unset {SWITCH} to run {engine} without a2ad."
        )
    return version


def env_options(default_timeout: float | None = None) -> dict:
    """The communication options an engine plugin takes from the environment:
    ``A2AD_ON_PEER_LOSS`` ("raise", the default, or "degrade"), ``A2AD_RUNTIME_DIR`` when set,
    and ``A2AD_TIMEOUT`` seconds (``default_timeout`` when unset; left out when both are None)."""
    policy = os.environ.get("A2AD_ON_PEER_LOSS", "raise")
    if policy not in ("raise", "degrade"):
        raise RuntimeError(f"A2AD_ON_PEER_LOSS must be 'raise' or 'degrade', got {policy!r}")
    opts = {"on_peer_loss": policy}
    if os.environ.get("A2AD_RUNTIME_DIR"):
        opts["runtime_dir"] = os.environ["A2AD_RUNTIME_DIR"]
    timeout = os.environ.get("A2AD_TIMEOUT")
    if timeout:
        opts["timeout"] = float(timeout)
    elif default_timeout is not None:
        opts["timeout"] = default_timeout
    return opts
