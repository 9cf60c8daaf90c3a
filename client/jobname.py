"""A job name the ranks agree on when the caller gives none (``MoeAlltoAll(..., job=None)``).

FlashInfer callers hand over a communicator and no job name. Without ``job=``, the ranks
agree on one through the first of:

1. ``mnnvl_config.comm_backend`` (FlashInfer's ``MnnvlConfig``),
2. ``flashinfer.comm.mnnvl.MnnvlMemory.comm`` when FlashInfer is imported and set it,
3. the default ``torch.distributed`` process group, when it is initialized,
4. mpi4py's ``MPI.COMM_WORLD`` (FlashInfer's default communicator, its ``MpiComm``), when it
   has more than one rank and MPI is initialized (mpi4py imported), or the process was started
   by an MPI launcher (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``PMIX_RANK``, ...) and mpi4py
   is installed: then it is imported, as FlashInfer imports it;

anything with FlashInfer's ``CommBackend`` methods (``Get_rank``, ``Get_size``,
``allgather``, ``bcast``) serves. The communicator's rank 0 makes a name that is new on
the machine (the geometry, a random part) and broadcasts it, so two serving engines of the
same geometry on one node never join each other's job. A communicator larger than the
expert-parallel group (several EP groups, say TP x EP) is split by each member's
``moe_ep_rank``: the i-th member holding each EP rank (in the communicator's order) is
in group i. With no communicator at all, InputError says to pass ``job=``.

An expert-parallel group of one rank (``ep_size == 1``) has no one to agree with: it needs
neither ``job=`` nor a communicator, and takes a name of its own (the geometry, this
process's id and a random part), so that no other process's single-rank job of the same
geometry is ever the same job.

Within one process, instances of one geometry share one name, and with it one attachment,
while an instance of it is open (FlashInfer's workspace cache): the collective runs only
for the first. Every rank must construct its instances in the same order.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading

from a2ad import errors

_LOCK = threading.Lock()
#: geometry key -> the job name of this process's open instances of that geometry
_NAMES: dict[tuple, str] = {}


class _TorchDist:
    """The default torch.distributed group as a CommBackend."""

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist

    def Get_rank(self) -> int:  # noqa: N802 (FlashInfer's names)
        return self._dist.get_rank()

    def Get_size(self) -> int:  # noqa: N802
        return self._dist.get_world_size()

    def allgather(self, data):
        out = [None] * self._dist.get_world_size()
        self._dist.all_gather_object(out, data)
        return out

    def bcast(self, data, root: int):
        box = [data]
        self._dist.broadcast_object_list(box, src=root)
        return box[0]


def communicator(mnnvl_config):
    """The communicator the ranks agree through, or None."""
    comm = getattr(mnnvl_config, "comm_backend", None) if mnnvl_config is not None else None
    if comm is not None:
        return comm
    mnnvl = sys.modules.get("flashinfer.comm.mnnvl")
    comm = getattr(getattr(mnnvl, "MnnvlMemory", None), "comm", None) if mnnvl is not None else None
    if comm is not None:
        return comm
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover (torch without distributed)
        return None
    if dist.is_available() and dist.is_initialized():
        return _TorchDist()
    return mpi_world()


#: environment variables MPI launchers set in the processes they start (MPICH/Hydra and Intel
#: MPI, Open MPI, PMIx launchers such as srun --mpi=pmix, MVAPICH)
_LAUNCHER_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def mpi_world():
    """mpi4py's COMM_WORLD when it can serve (see the module doc), else None. mpi4py is
    imported here only under an MPI launcher: importing it initializes MPI."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        if not any(os.environ.get(v) for v in _LAUNCHER_VARS):
            return None
        try:
            from mpi4py import MPI as mpi
        except ImportError:
            return None
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return None
        world = mpi.COMM_WORLD
        return world if world.Get_size() > 1 else None
    except Exception:  # an MPI that cannot answer is no communicator
        return None


def agree(key: tuple, ep_rank: int, ep_size: int, mnnvl_config, held, label: str = "") -> str:
    """The job name for ``key`` (this rank's geometry): this process's, while ``held(name)``
    says an instance of it is open, else a new one agreed through the communicator."""
    with _LOCK:
        name = _NAMES.get(key)
    if name is not None and held(name):
        return name
    if ep_size == 1:
        name = f"fi-{label or ep_size}-solo-{os.getpid()}-{secrets.token_hex(6)}"
        with _LOCK:
            _NAMES[key] = name
        return name
    comm = communicator(mnnvl_config)
    if comm is None:
        raise errors.InputError(
            "MoeAlltoAll needs a job name its ranks share: pass job=... (the same on every rank, unique on the "
            "machine), or give a communicator to agree on one: mnnvl_config=MnnvlConfig(comm_backend=...), "
            "FlashInfer's MnnvlMemory.comm, an initialized torch.distributed default group, or mpi4py's "
            "COMM_WORLD (under an MPI launcher)",
            argument="job")
    try:
        size, rank = int(comm.Get_size()), int(comm.Get_rank())
        members = comm.allgather(ep_rank)
        base = comm.bcast(f"fi-{label or ep_size}-{secrets.token_hex(8)}" if rank == 0 else None, 0)
    except errors.A2ADError:
        raise
    except Exception as exc:
        raise errors.InputError(
            f"agreeing on a job name through the communicator ({type(comm).__name__}) failed: {exc}; pass job=...",
            argument="job") from None
    members = [int(m) for m in members]
    if len(members) != size or size % ep_size or sorted(members) != sorted(list(range(ep_size)) * (size // ep_size)):
        raise errors.InputError(
            f"the communicator's {size} ranks hold moe_ep_ranks {members}, which do not form groups of ep_size="
            f"{ep_size} ranks 0..{ep_size - 1}: pass job=...", argument="job")
    group = members[:rank].count(ep_rank)
    name = base if size == ep_size else f"{base}-g{group}"
    with _LOCK:
        _NAMES[key] = name
    return name

