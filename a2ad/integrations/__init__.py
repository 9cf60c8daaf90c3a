"""Serving-engine integrations: a ``flashinfer.moe_ep`` communication backed by a2ad
(:mod:`a2ad.integrations.flashinfer`) and the vLLM and SGLang plugins
(:mod:`a2ad.integrations.vllm`, :mod:`a2ad.integrations.sglang`), which an engine loads
through its plugin entry point and which act only when ``A2AD_ENGINE_PLUGIN=1``
(docs/ENGINES.md)."""

import os

#: The one switch that turns the engine plugins on (off by default).
SWITCH = "A2AD_ENGINE_PLUGIN"


def enabled() -> bool:
    """Whether ``A2AD_ENGINE_PLUGIN`` is set to 1 (or true/yes/on)."""
    return os.environ.get(SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


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
