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
launcher). ``python -m a2ad.bench.kernel_timing`` times the CUDA kernels alone on two GPUs.
"""

from .cli import build_parser, main, prepare_flashinfer_archive, resolve_config
from .common import IMPLS, SCHEMA, Skip, exception_text
from .impls import FLASHINFER_MODULE, A2adJob, FiJob, a2ad_graphs, flashinfer_probe
from .plotting import plot, plot_unavailable
from .report import (
    VS_NCCL_NOTE,
    TABLE_COLUMNS,
    format_capture,
    format_eager_comparison,
    format_graph_comparison,
    format_markdown_table,
    format_table,
    format_targets,
    make_report,
    perf_doc,
    write_json,
)
from .results import add_comparisons, add_speedups, build_row, capture_summary, comparisons, evaluate_targets
from .timing import Ctx, percentile, run_eager, step_latencies, summarize
from .workload import (
    FULL_TOKENS,
    Inputs,
    check_combine,
    check_received,
    combine_bytes_per_token,
    dispatch_bytes_per_token,
    expert_owner_tensor,
    expert_weights,
    gbps,
    logical_bytes,
    make_inputs,
    make_routing,
    pack_rows,
    permute_indices,
    reference_combine,
    remote_bytes,
    remote_pairs,
    same_rows_as_sets,
    target_mask,
    unpack_rows,
    unpermute_sum,
)

__all__ = [
    "A2adJob", "Ctx", "FLASHINFER_MODULE", "FULL_TOKENS", "FiJob", "IMPLS", "Inputs", "SCHEMA", "Skip",
    "TABLE_COLUMNS", "VS_NCCL_NOTE", "a2ad_graphs", "add_comparisons", "add_speedups", "build_parser", "build_row",
    "capture_summary", "check_combine", "check_received", "combine_bytes_per_token", "comparisons",
    "dispatch_bytes_per_token", "evaluate_targets", "exception_text", "expert_owner_tensor", "expert_weights",
    "flashinfer_probe", "format_capture", "format_eager_comparison", "format_graph_comparison",
    "format_markdown_table", "format_table", "format_targets", "gbps", "logical_bytes", "main", "make_inputs",
    "make_report", "make_routing", "pack_rows", "percentile", "perf_doc", "permute_indices", "plot",
    "plot_unavailable", "prepare_flashinfer_archive", "reference_combine", "remote_bytes", "remote_pairs",
    "resolve_config", "run_eager", "same_rows_as_sets", "step_latencies", "summarize", "target_mask",
    "unpack_rows", "unpermute_sum", "write_json",
]
