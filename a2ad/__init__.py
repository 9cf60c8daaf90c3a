"""a2ad: the per-node daemon for MoE expert-parallel all-to-all workspaces."""

__version__ = "0.1.0"
