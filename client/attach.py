"""Attach to a job: join through the daemon, wait for the rendezvous, redeem the ticket
on the fd socket, and map every rank's workspace plus the job's control block."""

from __future__ import annotations

import os
import socket
import time
import warnings
from dataclasses import dataclass

import torch

from a2ad import errors, fdpass, layout as L, protocol
from a2ad.control import ControlBlock

from .connection import DaemonClient

#: Extra seconds the client waits beyond its rendezvous timeout for the daemon's verdict.
REPLY_MARGIN = 5.0


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


@dataclass
class Attachment:
    """One rank's view of a job: every rank's workspace mapped, plus the control block.

    ``workspace`` is a ``[ep_size, size_per_rank]`` uint8 tensor (CPU on the host
    backend, CUDA on the cuda backend) with ``stride(0) == row_stride``; row q is rank
    q's memory. The attachment is a lease: while it is open the daemon counts this rank
    as attached; ``close()`` leaves cleanly, a dead process is seen as a death.
    """

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
    control_device_ptr: int | None = None
    _mapping: object = None
    _lease_sock: socket.socket | None = None
    _lease: bytes | None = None
    _client: DaemonClient | None = None
    _closed: bool = False
    _next_lease_check: float = 0.0
    _lease_backoff: float = 0.5

    @property
    def runtime_dir(self):
        return self._client.runtime_dir

    def request(self, rtype: str, **fields) -> dict:
        """Send a request to the daemon this rank is attached through."""
        return self._client.request(rtype, **fields)

    # ------------------------------------------------------------ failures
    def recover(self, timeout: float = 60.0) -> int:
        """Wait for the job-wide re-arm after a PeerLost or PeerTimeout and return the new
        generation. The caller must have nothing in flight (a CUDA caller synchronizes its
        stream first; MoeAlltoAll.recover does). Blocks until every rank is present (a dead
        rank replaced by a new process) and has called recover, at most ``timeout`` seconds:
        then RendezvousTimeout naming the missing ranks."""
        self.maintain(force=True)
        reply = self._client.request(
            "recover", wait=timeout + REPLY_MARGIN, job=self.job, ep_rank=self.ep_rank, lease=self._lease, timeout=float(timeout)
        )
        self.generation = reply["generation"]
        return self.generation

    def lease_alive(self) -> bool:
        """False once the daemon end of the lease connection closed (daemon restarted or gone)."""
        import select

        if self._lease_sock is None:
            return False
        readable, _, _ = select.select([self._lease_sock], [], [], 0)
        if not readable:
            return True
        try:
            data = self._lease_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        return bool(data)

    def renew(self, timeout: float = 2.0) -> None:
        """Open a new lease connection to the (restarted) daemon."""
        reply = self._client.request(
            "renew", wait=timeout, job=self.job, ep_rank=self.ep_rank, lease=self._lease, pid=os.getpid()
        )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.connect(str(self._client.fd_path))
            fdpass.send_frame(sock, {"v": protocol.PROTOCOL_VERSION, "ticket": reply["ticket"]})
            answer, fds = fdpass.recv_frame(sock, timeout=timeout)
            for fd in fds:
                os.close(fd)
            if not isinstance(answer, dict) or not answer.get("ok"):
                raise errors.from_reply(answer.get("code", "protocol_error"), answer.get("message", "renew refused"))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        if self._lease_sock is not None:
            self._lease_sock.close()
        self._lease_sock = sock

    def maintain(self, force: bool = False) -> None:
        """Cheap and rate-limited, called on the data path: if the daemon restarted, reconnect
        the lease. It never waits on an absent daemon (a socket left by a dead one refuses the
        connection at once) and backs off exponentially (up to 8 s) while there is none."""
        now = time.monotonic()
        if not force and now < self._next_lease_check:
            return
        self._next_lease_check = now + self._lease_backoff
        if self.lease_alive():
            self._lease_backoff = 0.5
            return
        if not self._daemon_listening():
            self._lease_backoff = min(8.0, self._lease_backoff * 2)
            return
        try:
            self.renew(timeout=1.0)
            self._lease_backoff = 0.5
        except (errors.A2ADError, OSError, TimeoutError):
            self._lease_backoff = min(8.0, self._lease_backoff * 2)

    def _daemon_listening(self) -> bool:
        """Whether a daemon accepts connections on fd.sock (no waiting: a stale socket file
        refuses at once)."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.setblocking(False)
            probe.connect(str(self._client.fd_path))
            return True
        except (BlockingIOError, InterruptedError):
            return True  # the listener's backlog is full: it is there
        except OSError:
            return False
        finally:
            probe.close()

    def close(self) -> None:
        """Leave the job (best effort when the daemon is gone) and unmap everything."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client.request("leave", wait=2.0, job=self.job, ep_rank=self.ep_rank, lease=self._lease)
        except errors.A2ADError:
            pass  # daemon gone or job destroyed: closing the lease socket still says we left
        if self._lease_sock is not None:
            self._lease_sock.close()
            self._lease_sock = None
        self.workspace = None
        if self.control_device_ptr is not None:
            try:
                from .cuda_map import unregister_host_memory

                unregister_host_memory(self.control.address())
            except Exception:
                pass
            self.control_device_ptr = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        self.control.close()
        self._client.close()

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            warnings.warn(f"a2ad attachment {self.job}/{self.ep_rank} was never closed", ResourceWarning, stacklevel=2)


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
) -> Attachment:
    """Join ``job`` as ``ep_rank`` of ``ep_size`` and map every rank's workspace.

    Blocks until all ranks have joined, at most ``timeout`` seconds (then
    RendezvousTimeout listing the missing ranks). Give either
    ``workspace_size_per_rank`` or both per-token byte counts.
    """
    client = DaemonClient(runtime_dir)
    try:
        hello = client.request("hello", wait=min(timeout, 10.0))
        dev_str, tdev = _device_of(hello["backend"], device)
        spec = {"max_num_tokens": max_num_tokens, "top_k": top_k, "num_experts": num_experts}
        for key, val in (
            ("workspace_size_per_rank", workspace_size_per_rank),
            ("dispatch_bytes_per_token", dispatch_bytes_per_token),
            ("combine_bytes_per_token", combine_bytes_per_token),
        ):
            if val is not None:
                spec[key] = val
        reply = client.request(
            "join",
            wait=timeout + REPLY_MARGIN,
            job=job,
            ep_rank=ep_rank,
            ep_size=ep_size,
            spec=spec,
            pid=os.getpid(),
            device=dev_str,
            timeout=float(timeout),
        )
        aux = L.aux_layout(ep_size, reply["spec"]["max_num_tokens"])
        if list(reply["metainfo"]) != aux.metainfo():
            raise errors.ProtocolError("the daemon's workspace layout differs from this client's (version skew?)")
        return _redeem(client, reply, aux, tdev)
    except BaseException:
        client.close()
        raise


def _redeem(client: DaemonClient, reply: dict, aux: L.AuxLayout, tdev: torch.device) -> Attachment:
    ep_size = reply["ep_size"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    mapping = control = None
    try:
        sock.settimeout(10.0)
        try:
            sock.connect(str(client.fd_path))
        except OSError as exc:
            raise errors.DaemonUnavailable(f"cannot connect to {client.fd_path}: {exc}") from None
        fdpass.send_frame(sock, {"v": protocol.PROTOCOL_VERSION, "ticket": reply["ticket"]})
        try:
            answer, fds = fdpass.recv_frame(sock, timeout=10.0)
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise errors.DaemonUnavailable(f"no handles came from {client.fd_path}: {exc}") from None
        if not isinstance(answer, dict) or not answer.get("ok"):
            code = answer.get("code", "protocol_error") if isinstance(answer, dict) else "protocol_error"
            msg = answer.get("message", "bad answer") if isinstance(answer, dict) else "bad answer"
            raise errors.from_reply(code, msg)
        if len(fds) != ep_size + 1:
            raise errors.ProtocolError(f"expected {ep_size + 1} file descriptors, received {len(fds)}")
        size, stride = reply["size_per_rank"], reply["row_stride"]
        if reply["backend"] == "host":
            from .host_map import HostMapping

            mapping = HostMapping(fds[:ep_size], size, stride)
        else:
            from .cuda_map import CudaMapping

            mapping = CudaMapping(fds[:ep_size], size, stride, tdev.index)
        control = ControlBlock.map_fd(fds[ep_size])
        sock.settimeout(None)
        att = Attachment(
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
            _mapping=mapping,
            _lease_sock=sock,
            _lease=reply["lease"],
            _client=client,
        )
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
