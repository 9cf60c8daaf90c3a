"""a2ad-bench: dispatch/combine latency and bandwidth of a2ad against FlashInfer and NCCL baselines.

One process per rank, one rank per GPU (``torch.multiprocessing`` spawn). The
launcher starts an a2ad daemon (``a2ad serve --backend cuda``, through a2ad.tools.launcher) on a
private runtime folder unless ``--runtime-dir`` names a running one, then every
rank attaches through ``MoeAlltoAll(job=...)`` and, in the same run, on the same
GPUs, runs:

- ``a2ad``: the public ``MoeAlltoAll.dispatch``/``combine`` captured in CUDA graphs
  (dispatch, combine, and dispatch + no-op expert + combine, each in its own graph);
  when capturing the API raises, the graphs fall back to MoeAlltoAll's CUDA-plane
  kernels (``--capture plane`` forces that) and the report says so and why;
- ``a2ad-eager``: the public API called eagerly, many pairs back to back, one synchronize;
- ``flashinfer`` / ``flashinfer-eager``: FlashInfer's ``MoeAlltoAll``
  (``flashinfer.comm.trtllm_moe_alltoall``) timed and checked exactly like a2ad, when it
  imports (``pip install flashinfer-python``, or ``--flashinfer-archive``); skipped with the
  reason otherwise;
- ``nccl``: the Megatron-style all-to-all through ``torch.distributed``
  (count exchange, permutation, ``all_to_all_single`` with splits, inverse
  permutation + sum), eager only: its splits need a host sync, so it cannot be captured;
- ``agrs``: all-gather dispatch + reduce-scatter combine through NCCL, eager;
- the NVLink ceilings: a two-way copy-engine copy GPU0<->GPU1 and an SM-driven
  two-way peer store into the a2ad-mapped workspace.

Every implementation is checked (dispatch: the received rows per source as a set;
combine: against a float64 reference and against a2ad's output). Results: a
table on stdout (plus graph-vs-graph and eager-vs-eager comparisons), ``--json``,
``--plot``, ``--write-perf-doc``. ``--dry-run`` runs the whole pipeline on CPU (gloo
stands in for NCCL, the host backend for CUDA). benchmarks/README.md says what every
figure means.

The modules: ``workload`` (grid, routing and inputs, reference results and checks), ``timing``
(statistics, the rank's context, CUDA-graph and eager timing), ``impls`` (the implementations),
``ceilings`` (the NVLink ceilings), ``results`` (rows, comparisons, targets), ``report`` (tables,
JSON, PERF.md), ``plotting`` (``--plot``), ``worker`` (one rank's process), ``cli`` (options and the
launcher). ``python -m a2ad.bench.kernel_timing`` times the CUDA kernels alone on two GPUs, and
``python -m a2ad.bench.probe`` checks what the cuda backend relies on (driver, export/import,
peer mappings).

The names below load their module on first use, so that a submodule that must not import
torch (the probe's daemon-like children) can be run with ``-m``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_parser": "cli",
    "main": "cli",
    "prepare_flashinfer_archive": "cli",
    "resolve_config": "cli",
    "IMPLS": "common",
    "SCHEMA": "common",
    "Skip": "common",
    "exception_text": "common",
    "A2adJob": "impls",
    "FLASHINFER_MODULE": "impls",
    "FiJob": "impls",
    "a2ad_graphs": "impls",
    "flashinfer_probe": "impls",
    "plot": "plotting",
    "plot_unavailable": "plotting",
    "TABLE_COLUMNS": "report",
    "VS_NCCL_NOTE": "report",
    "format_capture": "report",
    "format_eager_comparison": "report",
    "format_graph_comparison": "report",
    "format_markdown_table": "report",
    "format_table": "report",
    "format_targets": "report",
    "make_report": "report",
    "perf_doc": "report",
    "write_json": "report",
    "add_comparisons": "results",
    "add_speedups": "results",
    "build_row": "results",
    "capture_summary": "results",
    "comparisons": "results",
    "evaluate_targets": "results",
    "Ctx": "timing",
    "percentile": "timing",
    "run_eager": "timing",
    "step_latencies": "timing",
    "summarize": "timing",
    "FULL_TOKENS": "workload",
    "Inputs": "workload",
    "check_combine": "workload",
    "check_received": "workload",
    "combine_bytes_per_token": "workload",
    "dispatch_bytes_per_token": "workload",
    "expert_owner_tensor": "workload",
    "expert_weights": "workload",
    "gbps": "workload",
    "logical_bytes": "workload",
    "make_inputs": "workload",
    "make_routing": "workload",
    "pack_rows": "workload",
    "permute_indices": "workload",
    "reference_combine": "workload",
    "remote_bytes": "workload",
    "remote_pairs": "workload",
    "same_rows_as_sets": "workload",
    "target_mask": "workload",
    "unpack_rows": "workload",
    "unpermute_sum": "workload",
}

__all__ = sorted(_EXPORTS)


_SUBMODULES = frozenset(_EXPORTS.values()) | {"ceilings", "kernel_timing", "worker", "probe"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # binds the attribute itself
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
