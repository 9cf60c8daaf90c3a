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
