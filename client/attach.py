"""Attach to a job: join through the daemon, wait for the rendezvous, redeem the ticket
on the fd socket, and map every rank's workspace plus the job's control block.

One process holds a rank once: a second attach of the same rank (same runtime folder,
job and rank; one MoeAlltoAll per layer, say) gets another handle to the same
attachment, and the last handle's close leaves the job. The share table is keyed by
pid too and cleared in a forked child, which also closes its copy of every lease socket
(a child must not keep the parent's lease alive, nor use its attachment)."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from a2ad import errors, fdpass, layout as L, protocol, runtime
from a2ad import control as _cb
from a2ad.control import ControlBlock, destroyed_message

from . import deathwatch
from .connection import DaemonClient

#: Extra seconds the client waits beyond its rendezvous timeout for the daemon's verdict.
REPLY_MARGIN = 5.0

log = logging.getLogger("a2ad.client")

#: Environment variable: the level of the "still waiting for ranks ..." lines logged while
#: attach() waits in the rendezvous (debug, info, warning, ...; off: none). Default: debug.
PROGRESS_ENV = "A2AD_PROGRESS"
#: Environment variable: seconds between those lines (default PROGRESS_EVERY).
PROGRESS_EVERY_ENV = "A2AD_PROGRESS_EVERY"
PROGRESS_EVERY = 2.0
#: Longest a progress query (job_info on a second connection) may take.
PROGRESS_QUERY_WAIT = 1.0
#: Seconds between two looks at the lease (and, while it is down, at the job's holder lock)
#: on the data path; lease renewals back off from this up to RENEW_BACKOFF_MAX.
LEASE_CHECK_EVERY = 0.5
RENEW_BACKOFF_MAX = 8.0
#: Seconds a renewal waits for the daemon's answer on fd.sock once it presented its ticket.
#: Longer than the request's own wait: the daemon may already have made that connection the
#: rank's lease, so a client that gave up and closed it would be taken for dead (a daemon that
#: re-adopts a job of 256 ranks answers 256 renewals at once).
RENEW_REDEEM_TIMEOUT = 5.0


def _device_of(backend: str, device) -> tuple[str, torch.device]:
    """(the device string the daemon gets, the torch device of the mapping)."""
    if backend == "host":
        if device is not None and torch.device(device).type != "cpu":
            raise errors.InvalidField(f"the daemon runs the host backend; device {device} cannot be used", field="device")
        return "host", torch.device("cpu")
    if not torch.cuda.is_available():
        raise errors.BackendError("the daemon runs the cuda backend but this process sees no CUDA device")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise errors.InvalidField(f"the daemon runs the cuda backend; device must be a CUDA device, got {dev}", field="device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = torch.cuda.get_device_properties(index).uuid
    return f"GPU-{uuid}", torch.device("cuda", index)


class RoundState:
    """This rank's round bookkeeping, shared by every MoeAlltoAll on one attachment.

    The workspace holds one round at a time per rank (its flag value, counters and
    payload regions are the rank's, not an object's), so whichever MoeAlltoAll
    dispatched owns the round until its combine: ``owner`` is that object's token
    and ``round`` what its combine needs. ``combine_floor`` is where the last
    round's combine region starts (peers may still read it; no dispatch may write
    past it), whichever object ran that round.
    """

    __slots__ = ("owner", "round", "combine_floor")

    def __init__(self, size_per_rank: int):
        self.owner: object | None = None
        self.round = None
        self.combine_floor = size_per_rank

    def reset(self, size_per_rank: int) -> None:
        self.owner = self.round = None
        self.combine_floor = size_per_rank


class _LeaseLost(Exception):
    """Ends the wait for a held request: the daemon end of the lease closed."""


class _DaemonGone(Exception):
    """Ends the wait for a held join: the daemon it was sent to is gone."""


def _listening(fd_path) -> bool:
    """Does a process listen on ``fd_path`` (one non-blocking connect, closed at once)?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.setblocking(False)
        probe.connect(str(fd_path))
        return True
    except (BlockingIOError, InterruptedError):
        return True  # the listener's backlog is full: it is there
    except OSError:
        return False
    finally:
        probe.close()


@dataclass(eq=False)
class _Shared:
    """One process's attachment of one rank: the mapping, the control block and the lease.

    Every :class:`Attachment` handle of that rank in this process points here; the last
    handle's close releases it (leaves the job and unmaps)."""

    job: str
    ep_rank: int
    ep_size: int
    spec: dict
    backend: str
    handle_type: str
    device: torch.device
    workspace: torch.Tensor
    size_per_rank: int
    row_stride: int
    aux: L.AuxLayout
    control: ControlBlock
    generation: int
    #: row offset of the rows' lines tail (layout.ROW_TAIL_BYTES past each row; 0: none)
    lines_tail: int = 0
    _mapping: object = None
    _lease_sock: socket.socket | None = None
    _lease: bytes | None = None
    _client: DaemonClient | None = None
    _closed: bool = False
    _next_lease_check: float = 0.0
    _next_renew: float = 0.0
    _lease_backoff: float = LEASE_CHECK_EVERY
    #: this process's own open file description of the control block (its rank lock and its
    #: holder-lock test; -1: none, e.g. without /proc), and whether the holder lock is watched
    _cb_fd: int = -1
    _watch_holder: bool = False
    #: the process that attached (a forked child inherits the object, not the attachment)
    pid: int = field(default_factory=os.getpid)
    forked: bool = False
    #: the share table's key, and how many open handles point here (both under _TABLE_LOCK)
    key: tuple | None = None
    refs: int = 0
    #: serializes requests on the daemon connection (DaemonClient is not thread-safe)
    lock: threading.RLock = field(default_factory=threading.RLock)
    rounds: RoundState | None = None

    def __post_init__(self):
        self.rounds = RoundState(self.size_per_rank)

    @property
    def destroyed(self) -> bool:
        return not self._closed and self.control.destroyed

    def raise_if_destroyed(self) -> None:
        if self.destroyed:
            if self.control.abort_word == L.ABORT_ORPHANED:
                raise errors.JobDestroyed(_cb.orphaned_message(self.job), job=self.job, reason=L.ABORT_ORPHANED)
            raise errors.JobDestroyed(destroyed_message(self.job), job=self.job, reason=L.ABORT_DESTROYED)

    def shareable(self) -> bool:
        """Whether a new attach of this rank in this process may use this attachment."""
        return not self._closed and not self.forked and self.pid == os.getpid() and not self.control.destroyed

    def check_same(self, ep_size: int, spec: dict, tdev: torch.device) -> None:
        """Raise SpecMismatch naming the first field where a second attach of this rank differs."""
        if ep_size != self.ep_size:
            raise errors.SpecMismatch(
                f"job {self.job!r}: ep_size differs (this process attached rank {self.ep_rank} with "
                f"{self.ep_size}, this attach asked for {ep_size})",
                field="ep_size",
                job_value=self.ep_size,
                requested=ep_size,
            )
        for key in sorted(set(self.spec) | set(spec)):
            a, b = self.spec.get(key), spec.get(key)
            if a != b:
                raise errors.SpecMismatch(
                    f"job {self.job!r}: spec field {key} differs (this process attached rank {self.ep_rank} "
                    f"with {a}, this attach asked for {b})",
                    field=key,
                    job_value=a,
                    requested=b,
                )
        if tdev != self.device:
            raise errors.SpecMismatch(
                f"job {self.job!r}: this process attached rank {self.ep_rank} on {self.device}, "
                f"this attach asked for {tdev}",
                field="device",
                job_value=str(self.device),
                requested=str(tdev),
            )

    # ------------------------------------------------------------ daemon
    def request(self, rtype: str, **fields) -> dict:
        with self.lock:
            return self._client.request(rtype, **fields)

    def recover(self, timeout: float) -> int:
        """Wait in the daemon's re-arm, ``timeout`` s in all (plus REPLY_MARGIN for its answer).

        The daemon holds the request until every rank is there, but it does not keep held
        requests across a restart. So while the request is held, its end of the lease is
        watched: once it closes, this waits for a daemon to listen again, renews the lease
        with it and asks again for the time that is left."""
        self.raise_if_destroyed()
        deadline = time.monotonic() + timeout
        with self.lock:
            self.maintain(force=True)
            if not self.lease_alive():
                self._await_daemon(deadline, timeout)
            while True:
                generation = self.control.generation
                left = max(0.0, deadline - time.monotonic())
                try:
                    reply = self._client.request(
                        "recover", wait=left + REPLY_MARGIN,
                        on_wait=self._raise_if_lease_lost if self.lease_alive() else None,
                        wait_step=LEASE_CHECK_EVERY,
                        job=self.job, ep_rank=self.ep_rank, lease=self._lease, timeout=left,
                    )
                except _LeaseLost:
                    self._client.close()  # the held request went with its daemon: no late answer is read
                    if self.control.generation != generation:
                        # re-armed just before the daemon went: only its answer to this rank was lost
                        self.generation = self.control.generation
                        return self.generation
                    self._await_daemon(deadline, timeout)
                    continue
                except (errors.JobDestroyed, errors.NoSuchJob):
                    # destroyed before or while this rank waited (the daemon has no such job left)
                    raise errors.JobDestroyed(destroyed_message(self.job), job=self.job, reason=L.ABORT_DESTROYED) from None
                self.generation = reply["generation"]
                return self.generation

    def _raise_if_lease_lost(self, elapsed: float) -> None:
        """``on_wait`` of a held request: the daemon end of the lease closed (that daemon is
        gone, and the request it held with it)."""
        if not self.lease_alive():
            raise _LeaseLost

    def _await_daemon(self, deadline: float, timeout: float) -> None:
        """:func:`_await_daemon` for the held recover, with maintain's look at every step (a
        renewal once a daemon listens; a job no daemon or fd store holds is marked orphaned,
        raised as JobDestroyed): returns once the lease is up again, or once a daemon listens
        that did not renew it (its answer to the next request says why)."""

        def renewed() -> bool:
            self.maintain(force=True)
            self.raise_if_destroyed()
            return self.lease_alive()

        _await_daemon(self._client, deadline, timeout, self.job, self.ep_rank, "recover",
                      "again (the one holding the job went away)", renewed)

    def lease_alive(self) -> bool:
        sock = self._lease_sock
        if sock is None:
            return False
        try:
            fd = sock.fileno()
        except OSError:
            return False
        if fd < 0:
            return False
        poller = select.poll()  # poll, not select(): this process may hold fds above 1024
        poller.register(fd, select.POLLIN | select.POLLPRI)
        if not poller.poll(0):
            return True
        try:
            data = self._lease_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        return bool(data)

    def renew(self, timeout: float = 2.0) -> None:
        with self.lock:
            fields = dict(job=self.job, ep_rank=self.ep_rank, lease=self._lease, pid=os.getpid())
            try:
                reply = self._client.request("renew", wait=timeout, watch=deathwatch.tids(), **fields)
            except errors.InvalidField as exc:
                if exc.details.get("field") != "watch":
                    raise
                reply = self._client.request("renew", wait=timeout, **fields)  # a daemon without watch threads
            sock, fds = redeem_ticket(self._client, reply["ticket"], 0, max(timeout, RENEW_REDEEM_TIMEOUT))
            fdpass.close_all(fds)
            if self._lease_sock is not None:
                self._lease_sock.close()
            self._lease_sock = sock

    def maintain(self, force: bool = False) -> None:
        """Every LEASE_CHECK_EVERY s at most: a look at the lease (one poll); while it is
        down, a test of the job's holder lock (one fcntl) and a renewal with backoff. Never
        raises: a job no daemon or fd store holds any more is marked in the control block
        (ABORT_ORPHANED), which the next call raises as JobDestroyed."""
        now = time.monotonic()
        if not force and now < self._next_lease_check:
            return
        # another thread talking to the daemon on this attachment (a recover, say) is
        # not waited for on the data path: the check comes again soon
        if not self.lock.acquire(blocking=force):
            return
        try:
            self._next_lease_check = now + LEASE_CHECK_EVERY
            if self._closed or self.lease_alive():
                self._lease_backoff = LEASE_CHECK_EVERY
                self._next_renew = 0.0
                return
            if self._orphaned():
                return
            if not force and now < self._next_renew:
                return
            if not self._daemon_listening():
                self._renew_later(now)
                return
            try:
                self.renew(timeout=1.0)
                self._lease_backoff = LEASE_CHECK_EVERY
                self._next_renew = 0.0
            except (errors.A2ADError, OSError, TimeoutError):
                self._renew_later(now)
        finally:
            self.lock.release()

    def _renew_later(self, now: float) -> None:
        self._lease_backoff = min(RENEW_BACKOFF_MAX, self._lease_backoff * 2)
        self._next_renew = now + self._lease_backoff

    def _orphaned(self) -> bool:
        """True (and the job marked ABORT_ORPHANED) when no daemon and no fd store holds
        the job any more: its holder lock is free."""
        if not self._watch_holder or self._cb_fd < 0:
            return False
        if self.control.destroyed:
            return True
        if _cb.job_held(self._cb_fd) is not False:
            return False
        self.control.set_abort(L.ABORT_ORPHANED, -1)  # every rank of the job, and its kernels, see it
        log.warning("job %r rank %d: no daemon and no fd store holds the job any more", self.job, self.ep_rank)
        return True

    def _daemon_listening(self) -> bool:
        return _listening(self._client.fd_path)

    # ------------------------------------------------------------ checkpoints
    def suspend(self) -> None:
        with self.lock:
            self._mapping.suspend()

    def resume(self) -> None:
        with self.lock:
            before = self.workspace.data_ptr()
            self._mapping.resume()
            if self._mapping.tensor.data_ptr() != before:
                raise errors.BackendError("the workspace was mapped again at another address")

    # ------------------------------------------------------------ teardown
    def forked_away(self) -> None:
        """In a forked child: this attachment is the parent's. Close the child's copy of the
        lease socket (else the parent's death would not end the lease while the child
        lives); the daemon connection and the mappings are not touched (CUDA and ZeroMQ
        must not be used across fork)."""
        self.forked = True
        sock, self._lease_sock = self._lease_sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        cfd, self._cb_fd = self._cb_fd, -1
        if cfd >= 0:
            try:
                os.close(cfd)
            except OSError:
                pass

    def release(self) -> None:
        """Leave the job (best effort when the daemon is gone) and unmap everything."""
        if self._closed:
            return
        if self.forked or self.pid != os.getpid():
            self._closed = True  # the parent's attachment: nothing of it is this process's to release
            self.forked_away()
            return
        with self.lock:
            destroyed = self.control.destroyed
            self._closed = True
            if not destroyed:  # a destroyed job has nothing to leave (its name may be a new job's)
                try:
                    self._client.request("leave", wait=2.0, job=self.job, ep_rank=self.ep_rank, lease=self._lease)
                except errors.A2ADError:
                    pass  # daemon gone or job destroyed: closing the lease socket still says we left
            if self._lease_sock is not None:
                self._lease_sock.close()
                self._lease_sock = None
            self.workspace = None
            if self._mapping is not None:
                self._mapping.close()
                self._mapping = None
            self.control.close()
            if self._cb_fd >= 0:
                os.close(self._cb_fd)  # with the mapping gone, this ends the rank lock
                self._cb_fd = -1
            self._client.close()


class Attachment:
    """One rank's view of a job: every rank's workspace mapped, plus the control block.

    ``workspace`` is a ``[ep_size, size_per_rank]`` uint8 tensor (CPU on the host
    backend, CUDA on the cuda backend) with ``stride(0) == row_stride``; row q is rank
    q's memory. The attachment is a lease: while it is open the daemon counts this rank
    as attached; ``close()`` leaves cleanly, a dead process is seen as a death.

    Within one process an attachment is shared: :func:`attach` of a rank this process
    already holds (same runtime folder, job and rank, identical ep_size, spec and device)
    returns another handle to the same mapping and lease, and only the last handle's
    ``close()`` leaves the job. A forked child shares nothing: it attaches for itself.
    """

    def __init__(self, shared: _Shared):
        self._shared = shared
        self._closed = False
        self._seen_generation = shared.generation

    # --- the attachment's fields (the same for every handle) ---------------------
    job = property(lambda self: self._shared.job)
    ep_rank = property(lambda self: self._shared.ep_rank)
    ep_size = property(lambda self: self._shared.ep_size)
    spec = property(lambda self: self._shared.spec)
    backend = property(lambda self: self._shared.backend)
    handle_type = property(lambda self: self._shared.handle_type)
    device = property(lambda self: self._shared.device)
    size_per_rank = property(lambda self: self._shared.size_per_rank)
    row_stride = property(lambda self: self._shared.row_stride)
    aux = property(lambda self: self._shared.aux)
    lines_tail = property(lambda self: self._shared.lines_tail)
    control = property(lambda self: self._shared.control)

    @property
    def on_peer_loss(self) -> str:
        """The job's peer-loss policy: "raise" or "degrade"."""
        return self._shared.spec.get("on_peer_loss", protocol.DEFAULT_PEER_LOSS)

    @property
    def active_ranks(self) -> list[int]:
        """The ranks the job counts as active now (a host read of the control block, no sync).
        Degrade jobs: the ranks in the active mask that take part in rounds (a replacement
        waiting for its first round is not one yet); raise jobs: every rank."""
        shared = self._live()
        if self.on_peer_loss != "degrade":
            return list(range(shared.ep_size))
        cb = shared.control
        rows = None
        if cb.row_admit_mask(shared.ep_size):
            # a replacement let in across nodes: its admit round is in its row (on the cuda
            # backend a copy of ep_size words; only while such a rank is in the mask)
            off = shared.aux.block_counters + 4 * L.SLOT_ADMIT_ROUND
            rows = shared.workspace[:, off: off + 4].view(torch.int32)[:, 0].cpu().tolist()
        return L.mask_ranks(cb.admitted_mask(shared.ep_size, rows=rows))

    @property
    def workspace(self) -> torch.Tensor | None:
        """The ``[ep_size, size_per_rank]`` uint8 mapping (None once this handle is closed)."""
        return None if self._closed else self._shared.workspace

    @property
    def generation(self) -> int:
        """The job's generation this rank runs at (bumped by every re-arm)."""
        return self._shared.generation

    @property
    def runtime_dir(self):
        return self._shared._client.runtime_dir

    @property
    def handles(self) -> int:
        """How many open handles of this process share the attachment."""
        return self._shared.refs

    @property
    def rounds(self) -> RoundState:
        """This rank's round bookkeeping, shared by every handle (for MoeAlltoAll)."""
        return self._shared.rounds

    @property
    def destroyed(self) -> bool:
        """Whether the daemon destroyed the job (JobDestroyed: attach again)."""
        return self._shared.destroyed

    @property
    def forked(self) -> bool:
        """True in a forked child: the attachment is the parent's, unusable here."""
        return self._shared.forked

    def raise_if_destroyed(self) -> None:
        """Raise JobDestroyed if the daemon destroyed the job."""
        self._shared.raise_if_destroyed()

    def _live(self) -> _Shared:
        shared = self._shared
        if self._closed or shared._closed:
            raise errors.StateError(f"the attachment of job {shared.job!r} rank {shared.ep_rank} is closed")
        if shared.forked:
            raise errors.StateError(
                f"the attachment of job {shared.job!r} rank {shared.ep_rank} belongs to pid {shared.pid}; "
                "a forked child must attach for itself"
            )
        return shared

    def request(self, rtype: str, **fields) -> dict:
        """Send a request to the daemon this rank is attached through."""
        return self._live().request(rtype, **fields)

    # ------------------------------------------------------------ failures
    def recover(self, timeout: float = 60.0) -> int:
        """Wait for the job-wide re-arm after a PeerLost or PeerTimeout and return the new
        generation. The caller must have nothing in flight (a CUDA caller synchronizes its
        stream first; MoeAlltoAll.recover does). Blocks until every rank is present (a dead
        rank replaced by a new process) and has called recover, at most ``timeout`` seconds:
        then RendezvousTimeout naming the missing ranks. A destroyed job cannot be
        recovered: JobDestroyed at once. A daemon that goes away while this waits (killed,
        stopped, restarted, upgraded) takes the held request with it: this renews the lease
        with the next daemon and asks it again for the time left; DaemonUnavailable when no
        daemon listened again within ``timeout``.

        Handles that share the attachment recover it once: when another handle already
        re-armed it since this one last looked, and nothing failed since, this returns the
        new generation without asking the daemon (which would re-arm the job again)."""
        return self._recover(timeout)[0]

    def _recover(self, timeout: float) -> tuple[int, bool]:
        """(generation, whether this call re-armed the job)."""
        shared = self._live()
        shared.raise_if_destroyed()
        with shared.lock:
            if shared.generation != self._seen_generation and self._healthy():
                self._seen_generation = shared.generation
                return shared.generation, False
            generation = shared.recover(timeout)
        self._seen_generation = generation
        return generation, True

    def _healthy(self) -> bool:
        ctl = self._shared.control
        return ctl.abort_word == L.ABORT_NONE and ctl.status(self._shared.ep_rank).code == L.STATUS_OK

    def suspend(self) -> None:
        """Unmap every rank's workspace, keeping its addresses reserved (checkpoint_prepare); the
        lease stays open and the job in the daemon. The caller quiesced its work first."""
        self._live().suspend()

    def resume(self) -> None:
        """Map the workspace again at the same addresses (checkpoint_restore)."""
        self._live().resume()

    def lease_alive(self) -> bool:
        """False once the daemon end of the lease connection closed (daemon restarted or gone)."""
        return self._shared.lease_alive()

    def renew(self, timeout: float = 2.0) -> None:
        """Open a new lease connection to the (restarted) daemon."""
        self._live().renew(timeout)

    def maintain(self, force: bool = False) -> None:
        """Cheap and rate-limited, called on the data path: if the daemon restarted, reconnect
        the lease. It never waits on an absent daemon (a socket left by a dead one refuses the
        connection at once) and backs off exponentially (up to 8 s) while there is none. While
        the lease is down it also tests, every 0.5 s, whether any daemon or fd store still
        holds the job; once none does, the next call raises JobDestroyed. Never raises."""
        self._live().maintain(force)

    def close(self) -> None:
        """Close this handle; the last open handle of the attachment leaves the job (best
        effort when the daemon is gone) and unmaps everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        shared = self._shared
        with _TABLE_LOCK:
            shared.refs -= 1
            last = shared.refs <= 0
            if last and _TABLE.get(shared.key) is shared:
                _TABLE.pop(shared.key, None)
        if last:
            shared.release()

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self._closed = True
            shared = self._shared
            warnings.warn(f"a2ad attachment {shared.job}/{shared.ep_rank} was never closed", ResourceWarning, stacklevel=2)
            # a dropped handle no longer counts, so that the others' last close still leaves;
            # no daemon I/O here (the attachment itself goes when its last handle does, and
            # with it the lease). Skipped if the table is busy (a collection inside attach).
            lock = _TABLE_LOCK
            if lock is not None and lock.acquire(blocking=False):  # None at interpreter exit
                try:
                    shared.refs -= 1
                    if shared.refs <= 0 and _TABLE.get(shared.key) is shared:
                        _TABLE.pop(shared.key, None)
                finally:
                    lock.release()

    def __repr__(self) -> str:
        shared = self._shared
        state = "closed" if self._closed else f"{shared.refs} handle(s)"
        return f"Attachment(job={shared.job!r}, rank={shared.ep_rank}/{shared.ep_size}, backend={shared.backend}, {state})"


# ---------------------------------------------------------------------------
# The process-wide share table
# ---------------------------------------------------------------------------
#: (pid, runtime folder, job, ep_rank) -> the attachment every handle of that rank uses. Weak:
#: the handles keep it alive, so one whose handles were all dropped unclosed goes away as an
#: unshared attachment would (its lease socket closes: the daemon sees the rank gone).
_TABLE: "weakref.WeakValueDictionary[tuple, _Shared]" = weakref.WeakValueDictionary()
#: keys an attach is in progress for (a second thread waits for it instead of joining twice)
_PENDING: dict[tuple, threading.Event] = {}
_TABLE_LOCK = threading.Lock()
#: every attachment not yet released, for the fork hook
_LIVE: "weakref.WeakSet[_Shared]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _TABLE_LOCK
    _TABLE_LOCK = threading.Lock()  # another thread of the parent may have held it
    _TABLE.clear()
    _PENDING.clear()
    for shared in list(_LIVE):
        if not shared._closed:
            shared.forked_away()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _share_key(runtime_dir, job: str, ep_rank: int) -> tuple:
    return (os.getpid(), os.path.realpath(runtime.resolve(runtime_dir)), job, int(ep_rank))


def held(runtime_dir, job: str, ep_rank: int) -> bool:
    """Whether this process holds an open, shareable attachment of ``job`` rank ``ep_rank``."""
    key = _share_key(runtime_dir, job, ep_rank)
    with _TABLE_LOCK:
        shared = _TABLE.get(key)
        return shared is not None and shared.shareable()


def _normalized(spec: dict, ep_size: int) -> dict:
    """The spec as the daemon compares it (workspace size filled in from per-token bytes)."""
    return protocol.normalize_spec(protocol.REQUESTS["join"]["spec"].check("spec", spec), ep_size)


def attach(
    job: str,
    ep_rank: int,
    ep_size: int,
    *,
    max_num_tokens: int,
    top_k: int,
    num_experts: int,
    workspace_size_per_rank: int | None = None,
    dispatch_bytes_per_token: int | None = None,
    combine_bytes_per_token: int | None = None,
    runtime_dir=None,
    device=None,
    timeout: float = 60.0,
    on_peer_loss: str = protocol.DEFAULT_PEER_LOSS,
) -> Attachment:
    """Join ``job`` as ``ep_rank`` of ``ep_size`` and map every rank's workspace.

    Blocks until all ranks have joined, at most ``timeout`` seconds (then
    RendezvousTimeout listing the missing ranks). Give either
    ``workspace_size_per_rank`` or both per-token byte counts. A daemon that goes away
    while this waits (killed, stopped, restarted, upgraded) takes the held join with it:
    this joins the next daemon anew for the time left, as it does when the daemon went after
    answering the join and before answering its ticket; DaemonUnavailable when no daemon
    listened again within ``timeout``. No daemon listening when it is called:
    DaemonUnavailable at once.

    ``on_peer_loss`` is part of the job's spec (every rank must pass the same: a join with
    another value is refused with SpecMismatch naming the field): ``"raise"`` (a dead or
    departed rank stops the job: every rank raises PeerLost and recovers once a replacement
    joined) or ``"degrade"`` (the others keep serving without it, and a replacement's join
    is let in without holding them up; docs/PROTOCOL.md, "Degraded mode"). A replacement
    for a rank of a degraded job that still serves is released at once, without waiting
    for the other ranks.

    When this process holds the rank already (an open attachment of the same job and
    rank through the same runtime folder), returns a new handle to that attachment
    at once: ep_size, spec and device must be identical (else SpecMismatch naming the
    field). Each handle is closed on its own; the last close leaves the job.
    """
    spec = {"max_num_tokens": max_num_tokens, "top_k": top_k, "num_experts": num_experts}
    protocol.check_peer_loss("on_peer_loss", on_peer_loss)
    if on_peer_loss != protocol.DEFAULT_PEER_LOSS:  # the default travels implicitly (older daemons know no field)
        spec["on_peer_loss"] = on_peer_loss
    for key, val in (
        ("workspace_size_per_rank", workspace_size_per_rank),
        ("dispatch_bytes_per_token", dispatch_bytes_per_token),
        ("combine_bytes_per_token", combine_bytes_per_token),
    ):
        if val is not None:
            spec[key] = val
    key = _share_key(runtime_dir, job, ep_rank)
    while True:
        with _TABLE_LOCK:
            shared = _TABLE.get(key)
            if shared is not None and not shared.shareable():
                _TABLE.pop(key, None)  # destroyed: its holders keep it until they close; a new attach joins anew
                shared = None
            if shared is not None:
                shared.check_same(ep_size, _normalized(spec, ep_size), _device_of(shared.backend, device)[1])
                shared.refs += 1
                return Attachment(shared)
            pending = _PENDING.get(key)
            if pending is None:
                mine = _PENDING[key] = threading.Event()
                break
        pending.wait()  # another thread of this process is attaching this rank; then share it
    try:
        shared = _join(job, ep_rank, ep_size, spec, runtime_dir, device, timeout)
    except BaseException:
        with _TABLE_LOCK:
            if _PENDING.get(key) is mine:
                del _PENDING[key]
        mine.set()
        raise
    with _TABLE_LOCK:
        shared.key = key
        shared.refs = 1
        _TABLE[key] = shared
        _LIVE.add(shared)
        if _PENDING.get(key) is mine:
            del _PENDING[key]
    mine.set()
    return Attachment(shared)


def _join(job, ep_rank, ep_size, spec, runtime_dir, device, timeout) -> _Shared:
    """Join and wait in the rendezvous: ``timeout`` s from the first sending of the join
    (plus REPLY_MARGIN for the daemon's answer).

    The daemon holds the join until every rank joined, but it does not keep held requests
    across a restart. So while the join is held, the daemon's process is watched
    (_DaemonWatch): once it is gone, this waits for a daemon to listen again and joins
    anew (hello, then join) for the time that is left. The same when the daemon went
    between its answer and the ticket's (redeem_ticket's DaemonUnavailable with ``gone``)."""
    client = DaemonClient(runtime_dir)
    progress = _Progress(runtime_dir, job, ep_rank, ep_size, timeout)
    deadline = None  # set when the join is first sent (or its daemon first seen gone)
    try:
        while True:
            reply, tdev, deadline = _ask_join(client, progress, job, ep_rank, ep_size, spec, device, timeout,
                                              deadline)
            progress.close()
            aux = L.aux_layout(ep_size, reply["spec"]["max_num_tokens"])
            if list(reply["metainfo"]) != aux.metainfo():
                raise errors.ProtocolError("the daemon's workspace layout differs from this client's (version skew?)")
            try:
                return _redeem(client, reply, aux, tdev)
            except errors.DaemonUnavailable as exc:
                # the daemon went between its answer and the ticket's: the next one holds the
                # rank free (a join in progress) or attached for this process (the state file
                # recorded the redeem); either way a join of this process takes it
                if not exc.details.get("gone") or time.monotonic() >= deadline:
                    raise
                client.close()
                log.info("job %r rank %d: the daemon went before it answered the ticket (%s); joining again within "
                         "the %.1f s left", job, ep_rank, exc.message, max(0.0, deadline - time.monotonic()))
                _await_daemon(client, deadline, timeout, job, ep_rank)
    except BaseException:
        client.close()
        raise
    finally:
        progress.close()


def _ask_join(client: DaemonClient, progress: "_Progress", job: str, ep_rank: int, ep_size: int, spec: dict, device,
              timeout: float, deadline: float | None) -> tuple[dict, torch.device, float]:
    """Send the join (hello first) and wait for its answer: the reply, the device and the
    join's deadline (set at its first sending, or when its daemon is first seen gone). A
    daemon that goes while the join is held is waited for and asked again for the time left."""
    while True:
        try:
            if deadline is None:
                wait = min(timeout, 10.0)
            else:  # asking anew: within what is left of the join's own wait
                wait = min(10.0, max(0.1, deadline + REPLY_MARGIN - time.monotonic()))
            hello = client.request("hello", wait=wait)
        except errors.DaemonUnavailable as exc:
            if deadline is None:
                raise
            # the daemon that listened again went away too, or did not answer in time
            client.close()
            if time.monotonic() >= deadline:
                raise _no_daemon(client, timeout, job, ep_rank) from exc
            _await_daemon(client, deadline, timeout, job, ep_rank)
            continue
        dev_str, tdev = _device_of(hello["backend"], device)
        # the threads whose end tells the daemon this process died (a daemon that predates
        # them does not take the field)
        features = hello.get("features") or ()
        optional = {"watch": deathwatch.tids()} if "watch" in features else {}
        # this client combines through the rows' lines tails where a job has them (a daemon that
        # predates the word gives them to every job of its CUDA backend, and takes no word)
        if "lines" in features:
            optional["lines"] = True
        try:
            daemon = _DaemonWatch(client)
            try:
                if deadline is None:
                    deadline, left = time.monotonic() + timeout, float(timeout)
                else:
                    left = max(0.0, deadline - time.monotonic())
                on_wait = _JoinWait(daemon, progress, deadline - timeout)
                reply = client.request(
                    "join",
                    wait=left + REPLY_MARGIN,
                    on_wait=on_wait,
                    wait_step=on_wait.step,
                    job=job,
                    ep_rank=ep_rank,
                    ep_size=ep_size,
                    spec=spec,
                    pid=os.getpid(),
                    device=dev_str,
                    timeout=left,
                    **optional,
                )
                return reply, tdev, deadline
            finally:
                daemon.close()
        except _DaemonGone:
            client.close()  # the held join went with its daemon: no late answer is read
            if deadline is None:
                deadline = time.monotonic() + timeout
            elif time.monotonic() >= deadline + REPLY_MARGIN:
                raise _no_daemon(client, timeout, job, ep_rank) from None
            log.info("job %r rank %d: the daemon went away while the join waited; waiting up to %.1f s for one "
                     "to listen at %s again", job, ep_rank, max(0.0, deadline - time.monotonic()),
                     client.runtime_dir)
            _await_daemon(client, deadline, timeout, job, ep_rank)


_JOIN_GONE = "again and take it (the one holding the rendezvous went away)"


def _await_daemon(client: DaemonClient, deadline: float, timeout: float, job: str, ep_rank: int,
                  what: str = "join", tail: str = _JOIN_GONE, look=None) -> None:
    """After the daemon holding a request (``what``: "join" or "recover") went away: until
    ``deadline``, every LEASE_CHECK_EVERY s, ``look()`` (when given; True ends the wait) and
    whether a daemon listens at the client's runtime folder. Returns once one does;
    DaemonUnavailable, saying what was waited for, when the time is up with none listening."""
    while True:
        if (look is not None and look()) or _listening(client.fd_path):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise _no_daemon(client, timeout, job, ep_rank, what, tail)
        time.sleep(min(LEASE_CHECK_EVERY, left))


def _no_daemon(client: DaemonClient, timeout: float, job: str, ep_rank: int, what: str = "join",
               tail: str = _JOIN_GONE) -> errors.DaemonUnavailable:
    return errors.DaemonUnavailable(
        f"job {job!r} rank {ep_rank}: {what} waited {timeout:g} s for a daemon to listen at {client.runtime_dir} "
        f"{tail}; none did",
        runtime_dir=str(client.runtime_dir), job=job, ep_rank=ep_rank,
    )


def _daemon_gone(client: DaemonClient, pid: int) -> bool:
    """Whether the daemon of ``pid`` no longer listens on fd.sock (one probe): nothing
    listens there, or a process with another pid (or an untrusted uid). ``pid`` as this
    process reads it (SO_PEERCRED): 0 for a daemon in a pid namespace it cannot see into,
    which every probe reads as 0 too, so that a restart of such a daemon goes unseen."""
    try:
        now = runtime.probe_daemon(client.runtime_dir, client.trust_uids, busy_wait=0.1)[0]
    except errors.PermissionDenied:
        return True  # someone else listens there now (the next hello says who)
    except errors.DaemonUnavailable as exc:
        return bool(exc.details.get("stale"))  # a full backlog: it is there
    return now != pid


class _DaemonWatch:
    """The process of the daemon a client just talked to (the listener on fd.sock, whose pid
    SO_PEERCRED gave ``client.daemon_cred``), watched through a pidfd: ``gone()`` is one
    poll, true once that process exited. Made before a request is sent: the pid is checked
    against the listener again after the pidfd is opened, so a pid that changed hands in
    between (a daemon that went, its pid taken by another process) is not watched in its
    place; a daemon seen gone then raises _DaemonGone at once.

    Where no pidfd can be had (no pidfd_open, a seccomp filter, a pid of 0: the daemon in a
    pid namespace this process cannot see into), ``gone()`` probes fd.sock instead, every
    PROBE_EVERY s at most: gone when nothing listens there, or when the listener's pid is
    another one. With no pid to compare (0), a restart between two probes goes unseen; the
    join then ends at its timeout, as without a watch."""

    PROBE_EVERY = 1.0

    def __init__(self, client: DaemonClient):
        self.client = client
        self.pid = client.daemon_cred[0] if client.daemon_cred else 0
        self.fd = -1
        self._next_probe = 0.0
        if self.pid > 0:
            try:
                self.fd = os.pidfd_open(self.pid)
            except (AttributeError, OSError) as exc:
                log.debug("cannot open a pidfd on the daemon's pid %d (%s): probing %s instead", self.pid, exc,
                          client.fd_path)
        try:
            if self._probe_gone() or self._exited():
                raise _DaemonGone
        except BaseException:
            self.close()
            raise
        self._next_probe = time.monotonic() + self.PROBE_EVERY

    def _exited(self) -> bool:
        if self.fd < 0:
            return False
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    def _probe_gone(self) -> bool:
        return _daemon_gone(self.client, self.pid)

    def gone(self) -> bool:
        if self.fd >= 0:
            return self._exited()
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + self.PROBE_EVERY
        return self._probe_gone()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _JoinWait:
    """``on_wait`` of a held join: raises _DaemonGone once the daemon holding it is gone
    (looked at every LEASE_CHECK_EVERY s), and calls ``progress`` every ``progress.every``
    s with the seconds since the first join was sent."""

    def __init__(self, daemon: _DaemonWatch, progress: "_Progress", started: float):
        self.daemon, self.progress, self.started = daemon, progress, started
        self.logs = progress.level is not None
        self.step = min(LEASE_CHECK_EVERY, progress.every)
        self._next_progress = time.monotonic() + progress.every

    def __call__(self, elapsed: float) -> None:
        if self.daemon.gone():
            raise _DaemonGone
        now = time.monotonic()
        if self.logs and now >= self._next_progress:
            self._next_progress = now + self.progress.every
            self.progress(now - self.started)


def _progress_settings() -> tuple[int | None, float]:
    """(log level or None for off, seconds between lines) from the environment."""
    name = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if name in ("off", "none", "0", "no", "false"):
        level = None
    else:
        level = logging.getLevelName(name.upper()) if name else logging.DEBUG
        if not isinstance(level, int):
            level = logging.DEBUG
    try:
        every = float(os.environ.get(PROGRESS_EVERY_ENV, PROGRESS_EVERY))
    except ValueError:
        every = PROGRESS_EVERY
    if not every > 0:  # also NaN
        every = PROGRESS_EVERY
    return level, max(every, 0.1)


class _Progress:
    """Called between polls of the held join reply: logs which ranks are still missing,
    asked with job_info on a second, short-lived connection (same thread). Never raises for
    a failed query and never runs past the rendezvous timeout."""

    def __init__(self, runtime_dir, job: str, ep_rank: int, ep_size: int, timeout: float):
        self.level, self.every = _progress_settings()
        self.runtime_dir, self.job, self.ep_rank, self.ep_size, self.timeout = runtime_dir, job, ep_rank, ep_size, timeout
        self._client: DaemonClient | None = None

    def __call__(self, elapsed: float) -> None:
        left = self.timeout - elapsed
        if self.level is None or left < 0.2 or not log.isEnabledFor(self.level):
            return
        wait = min(PROGRESS_QUERY_WAIT, left / 2)
        try:
            if self._client is None:
                self._client = DaemonClient(self.runtime_dir, timeout=wait)
            info = self._client.request("job_info", wait=wait, job=self.job)
            ranks = info["ranks"]
            missing = [r["rank"] for r in ranks if r["state"] not in ("joining", "attached")]
        except Exception as exc:  # progress is best effort
            log.debug("job %r rank %d: progress query failed: %s", self.job, self.ep_rank, exc)
            return
        if missing:
            log.log(self.level, "job %r rank %d: waiting %.0f s of %g s for rank(s) %s (%d of %d joined)",
                    self.job, self.ep_rank, elapsed, self.timeout, missing, len(ranks) - len(missing), len(ranks))
        else:
            log.log(self.level, "job %r rank %d: all %d ranks joined after %.0f s; waiting for the daemon",
                    self.job, self.ep_rank, len(ranks), elapsed)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def redeem_ticket(client: DaemonClient, ticket: bytes, nfds: int, timeout: float) -> tuple[socket.socket, list[int]]:
    """Present ``ticket`` on the daemon's fd socket; returns the connection (from then on the
    rank's lease) and the ``nfds`` file descriptors that came with the answer (the caller owns
    them). Join and lease renewal both come here. Bounded by ``timeout`` seconds; the
    daemon's refusal raises its error, a missing or silent daemon DaemonUnavailable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        # ``gone`` on the DaemonUnavailable below: the daemon that issued the ticket went
        # (killed, stopped, upgraded), so a new join can take the rank from the next one; not
        # where that daemon is still there (it shed the connection, say)
        issuer = client.daemon_cred[0] if client.daemon_cred else 0
        sock.settimeout(timeout)
        try:
            sock.connect(str(client.fd_path))
        except OSError as exc:
            raise errors.DaemonUnavailable(f"cannot connect to {client.fd_path}: {exc}",
                                           gone=_daemon_gone(client, issuer)) from None
        try:
            fdpass.send_frame(sock, {"v": protocol.PROTOCOL_VERSION, "ticket": ticket})
            answer, fds = fdpass.recv_frame_fds(sock, timeout=timeout)
        except TimeoutError as exc:
            raise errors.DaemonUnavailable(f"no answer to the ticket from {client.fd_path} within {timeout:g} s: "
                                           f"{exc}") from None
        except (ConnectionError, OSError) as exc:  # the connection ended unanswered
            raise errors.DaemonUnavailable(f"no answer to the ticket from {client.fd_path}: {exc}",
                                           gone=_daemon_gone(client, issuer)) from None
        if not isinstance(answer, dict) or not answer.get("ok"):
            code = answer.get("code", "protocol_error") if isinstance(answer, dict) else "protocol_error"
            msg = answer.get("message", "bad answer") if isinstance(answer, dict) else "bad answer"
            if code == "bad_ticket" and issuer > 0 and _daemon_gone(client, issuer):
                # another daemon listens now (restarted, upgraded): the ticket was the old one's
                raise errors.DaemonUnavailable(
                    f"the daemon that issued the ticket (pid {issuer}) went; the one listening at "
                    f"{client.fd_path} now does not know it: {msg}", gone=True)
            raise errors.from_reply(code, msg)
        if len(fds) != nfds:
            raise errors.ProtocolError(f"expected {nfds} file descriptors, received {len(fds)}")
        sock.settimeout(None)
        return sock, fds
    except BaseException:
        fdpass.close_all(fds)
        sock.close()
        raise


def _row_handles(reply: dict) -> list:
    """The workspace entries of a join reply in rank order: True for a row that comes as the
    next fd, its fabric handle (bytes) for a row another node's daemon holds (a job that spans
    nodes; protocol.py, "Handles in a join reply")."""
    ep_size = reply["ep_size"]
    rows = [h for h in reply["handles"] if isinstance(h, dict) and h.get("kind") == "workspace"]
    if [h.get("rank") for h in rows] != list(range(ep_size)):
        raise errors.ProtocolError("the join reply does not list one workspace per rank in rank order")
    out = []
    for h in rows:
        if h.get("fd", True):
            out.append(True)
        elif isinstance(h.get("fabric"), bytes):
            out.append(h["fabric"])
        else:
            raise errors.ProtocolError(f"rank {h.get('rank')}'s workspace comes with neither an fd nor a fabric handle")
    return out


def _check_control_handle(reply: dict) -> None:
    """Refuse a daemon whose control block has another size than this client's layout (a
    daemon of control-block layout version 1: one mask word, 4096 bytes), before anything is
    mapped: mapping 16 KiB of a 4 KiB block would fault."""
    size = next((h.get("size") for h in reply["handles"] if isinstance(h, dict) and h.get("kind") == "control"), None)
    if size != L.CONTROL_BLOCK_SIZE:
        raise errors.ProtocolError(
            f"the daemon's control block is {size} bytes; this client's layout (version {L.CONTROL_VERSION}, ep_size "
            f"up to {L.MAX_EP_SIZE}) needs {L.CONTROL_BLOCK_SIZE}: the daemon is of another a2ad release (version "
            "skew); run a client and a daemon of one release")


def _lines_tail(reply: dict) -> int:
    """The join reply's ``lines_tail`` (0, or the rows' last layout.ROW_TAIL_BYTES)."""
    tail = reply.get("lines_tail", 0)
    if tail:
        try:
            ok = tail == L.lines_tail_offset(reply["size_per_rank"], reply["row_stride"])
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise errors.ProtocolError(
                f"the daemon's lines_tail {tail!r:.40} is not the last {L.ROW_TAIL_BYTES} bytes of a row of "
                f"{reply['row_stride']} bytes past {reply['size_per_rank']} (version skew?)")
    return int(tail)


def _redeem(client: DaemonClient, reply: dict, aux: L.AuxLayout, tdev: torch.device) -> _Shared:
    ep_size = reply["ep_size"]
    _check_control_handle(reply)
    wanted = _row_handles(reply)
    nfds = sum(1 for h in wanted if h is True) + 1
    sock, fds = redeem_ticket(client, reply["ticket"], nfds, 10.0)
    mapping = control = None
    cb_fd = -1
    try:
        size, stride = reply["size_per_rank"], reply["row_stride"]
        taken = iter(fds)
        rows = [next(taken) if h is True else h for h in wanted]  # an fd, or a fabric handle
        if reply["backend"] == "host":
            from .host_map import HostMapping

            mapping = HostMapping(rows, size, stride)
        else:
            from .cuda_map import CudaMapping

            mapping = CudaMapping(rows, size, stride, tdev.index)
        cb_fd = _own_control_fd(fds[-1])
        control = ControlBlock.map_fd(cb_fd if cb_fd >= 0 else fds[-1])
        if not control.valid:
            raise errors.ProtocolError(
                f"the job's control block has layout version {control.version}; this client reads version "
                f"{L.CONTROL_VERSION}: the daemon is of another a2ad release (version skew)")
        watch = cb_fd >= 0 and _cb.mark_rank(cb_fd) and _cb.job_held(cb_fd) is True
        att = _Shared(
            job=reply["job"],
            ep_rank=reply["ep_rank"],
            ep_size=ep_size,
            spec=dict(reply["spec"]),
            backend=reply["backend"],
            handle_type=reply["handle_type"],
            device=tdev,
            workspace=mapping.tensor,
            size_per_rank=size,
            row_stride=stride,
            aux=aux,
            control=control,
            generation=reply["generation"],
            lines_tail=_lines_tail(reply),
            _mapping=mapping,
            _lease_sock=sock,
            _lease=reply["lease"],
            _client=client,
            _cb_fd=cb_fd,
            _watch_holder=watch,
        )
        cb_fd = -1
        return att
    except BaseException:
        sock.close()
        if mapping is not None:
            mapping.close()
        if control is not None:
            control.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
        if cb_fd >= 0:
            os.close(cb_fd)


def _own_control_fd(fd: int) -> int:
    """This process's own description of the control block (control.reopen), or -1 when it
    cannot be had (then the received fd is mapped and the holder lock is not watched). Its
    mapping must not keep the daemon's description alive, or the holder lock would never
    end while this rank lives."""
    try:
        return _cb.reopen(fd)
    except OSError as exc:
        log.debug("cannot reopen the control block through /proc (%s): not watching its holder", exc)
        return -1
