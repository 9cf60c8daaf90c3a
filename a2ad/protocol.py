"""The a2ad wire protocol: message schema, encoding and validation. No sockets here.

Frames
------
A client (ZeroMQ DEALER) sends one frame per request; the daemon (ROUTER) answers
with one frame. Each frame is a msgpack map.

Request::

    {"v": PROTOCOL_VERSION, "id": <int, echoed back>, "type": <str>, ...fields of that type}

Reply (the one envelope for every answer)::

    {"v": PROTOCOL_VERSION, "id": <request id or -1>, "ok": <bool>,
     "code": "ok" | <error code, see a2ad.errors.CODES>, "message": <str>,
     "payload": <map>}

On error, ``payload`` holds machine-readable details (e.g. ``field``,
``missing_ranks``). A frame that cannot be decoded gets a ``bad_message``
reply with id -1; a frame larger than ``MAX_FRAME`` is refused by the socket
itself and never reaches the daemon's logic.

The companion fd socket (``fd.sock``) speaks length-prefixed msgpack: a 4-byte
big-endian length, then the map. Its request is ``{"v", "ticket"}``; its reply
is a reply envelope (with ``nfds``: how many fds in all) whose ancillary data carries the
file descriptors (SCM_RIGHTS), in the order the join reply's ``handles`` list gives. A
frame carries at most 128 fds (``fdpass.MAX_FDS``; the kernel's cap is 253): past that,
continuation frames ``{"v", "more_fds": k}`` follow, each with the next k fds
(``fdpass.send_frame_fds``), so an ep_size 256 job's 257 fds arrive in three frames.

Request types and their fields are in :data:`REQUESTS`; every field is checked
by :func:`parse_request`, which raises the error class that the reply carries.

Handles in a join reply
-----------------------
``handles`` lists one ``{"kind": "workspace", "rank", "size", "device", ...}`` per rank,
then ``{"kind": "control", "size"}``. A workspace entry with ``"fd": false`` (a rank of a
job that spans nodes, whose row another node's daemon holds) carries its handle in
``"fabric"`` (bytes) instead of an fd: a CUDA fabric handle (64 bytes,
``cuMemImportFromShareableHandle`` with ``CU_MEM_HANDLE_TYPE_FABRIC``) or, on the host
backend, a shared-memory name (:func:`host_handle_path`). Every other entry (``"fd"`` true
or absent) takes the next fd of the redeemed ticket, in list order; the control block's is
the last. ``"node"`` names the node whose daemon holds the row (absent without a domain).
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from . import errors
from .layout import MAX_EP_SIZE, MAX_TOP_K

PROTOCOL_VERSION = 1
MAX_FRAME = 64 * 1024
#: Replies may be larger than requests: a status of hundreds of jobs runs past 64 KiB.
MAX_REPLY_FRAME = 16 * 1024 * 1024
MAX_JOB_NAME = 64
JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
MAX_TOKENS_LIMIT = 1 << 20
MAX_EXPERTS_LIMIT = 1 << 16
MAX_BYTES_PER_TOKEN = 1 << 24
MAX_SIZE_PER_RANK = 1 << 40
MAX_DEVICE_LEN = 128
TICKET_BYTES = 32


# ---------------------------------------------------------------------------
# Field checkers: each returns the cleaned value or raises InvalidField.
# ---------------------------------------------------------------------------
def _int(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise errors.InvalidField(f"{name} must be an integer, got {type(v).__name__}", field=name)
        if not lo <= v <= hi:
            raise errors.InvalidField(f"{name} must be in [{lo}, {hi}], got {v}", field=name)
        return v

    return check


def _number(lo: float, hi: float) -> Callable[[str, Any], float]:
    def check(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise errors.InvalidField(f"{name} must be a finite number", field=name)
        if not lo < v <= hi:
            raise errors.InvalidField(f"{name} must be in ({lo}, {hi}], got {v}", field=name)
        return float(v)

    return check


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise errors.InvalidField(f"{name} must be a boolean", field=name)
    return v


def check_job_name(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise errors.InvalidField(f"{name} must be a string", field=name)
    if not 1 <= len(v) <= MAX_JOB_NAME or not JOB_NAME_RE.fullmatch(v):
        raise errors.InvalidField(
            f"{name} must be 1-{MAX_JOB_NAME} characters of letters, digits and _.:- "
            f"starting with a letter or digit, got {v!r:.80}",
            field=name,
        )
    return v


def _device(name: str, v: Any) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_DEVICE_LEN or not v.isprintable():
        raise errors.InvalidField(f"{name} must be 'host' or a CUDA device UUID", field=name)
    return v


#: Watch threads a join or renew may name (``watch``: their thread ids).
MAX_WATCH_THREADS = 4


def _tids(name: str, v: Any) -> tuple[int, ...]:
    """Thread ids of the requester's watch threads: up to MAX_WATCH_THREADS distinct ids."""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_WATCH_THREADS:
        raise errors.InvalidField(f"{name} must be a list of at most {MAX_WATCH_THREADS} thread ids", field=name)
    tids = tuple(_int(1, 2**31 - 1)(f"{name}[{i}]", t) for i, t in enumerate(v))
    if len(set(tids)) != len(tids):
        raise errors.InvalidField(f"{name} names a thread twice", field=name)
    return tids


def _ticket(name: str, v: Any) -> bytes:
    if not isinstance(v, bytes) or len(v) != TICKET_BYTES:
        raise errors.InvalidField(f"{name} must be {TICKET_BYTES} bytes", field=name)
    return v


#: What a job does when one of its ranks dies or leaves while it runs (``spec.on_peer_loss``):
#: "raise" (the default: every rank raises PeerLost and recovers once a replacement joined) or
#: "degrade" (the others keep serving without it; docs/PROTOCOL.md, "Degraded mode").
PEER_LOSS_POLICIES = ("raise", "degrade")
DEFAULT_PEER_LOSS = "raise"


def check_peer_loss(name: str, v: Any) -> str:
    if not isinstance(v, str) or v not in PEER_LOSS_POLICIES:
        raise errors.InvalidField(
            f"{name} must be one of {', '.join(repr(p) for p in PEER_LOSS_POLICIES)}, got {v!r:.40}", field=name
        )
    return v


SPEC_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "max_num_tokens": _int(1, MAX_TOKENS_LIMIT),
    "top_k": _int(1, MAX_TOP_K),
    "num_experts": _int(1, MAX_EXPERTS_LIMIT),
    "workspace_size_per_rank": _int(1, MAX_SIZE_PER_RANK),
    "dispatch_bytes_per_token": _int(1, MAX_BYTES_PER_TOKEN),
    "combine_bytes_per_token": _int(1, MAX_BYTES_PER_TOKEN),
    "on_peer_loss": check_peer_loss,
}
SPEC_REQUIRED = ("max_num_tokens", "top_k", "num_experts")


def _spec(name: str, v: Any) -> dict:
    """A job spec. Either workspace_size_per_rank, or both per-token byte counts."""
    if not isinstance(v, dict):
        raise errors.InvalidField(f"{name} must be a map", field=name)
    unknown = [k for k in v if k not in SPEC_FIELDS]
    if unknown:
        raise errors.InvalidField(f"{name} has unknown field {unknown[0]!r:.40}", field=f"{name}.{unknown[0]}")
    out = {}
    for key in SPEC_REQUIRED:
        if key not in v:
            raise errors.InvalidField(f"{name}.{key} is required", field=f"{name}.{key}")
    for key, check in SPEC_FIELDS.items():
        if key in v and v[key] is not None:
            out[key] = check(f"{name}.{key}", v[key])
    has_size = "workspace_size_per_rank" in out
    has_bytes = "dispatch_bytes_per_token" in out and "combine_bytes_per_token" in out
    if not has_size and not has_bytes:
        raise errors.InvalidField(
            f"{name} needs workspace_size_per_rank, or dispatch_bytes_per_token and combine_bytes_per_token",
            field=f"{name}.workspace_size_per_rank",
        )
    return out


@dataclass(frozen=True)
class Field:
    check: Callable[[str, Any], Any]
    required: bool = True


#: Request type -> its fields (besides v, id, type). Each command's meaning and reply
#: payload are documented with its handler in a2ad/daemon/commands.py.
REQUESTS: dict[str, dict[str, Field]] = {
    "hello": {},
    "status": {},
    "jobs": {},
    "job_info": {"job": Field(check_job_name)},
    "join": {
        "job": Field(check_job_name),
        "ep_rank": Field(_int(0, MAX_EP_SIZE - 1)),
        "ep_size": Field(_int(1, MAX_EP_SIZE)),
        "spec": Field(_spec),
        "pid": Field(_int(1, 2**31 - 1)),
        "device": Field(_device),
        "timeout": Field(_number(0.0, 86400.0), required=False),
        "watch": Field(_tids, required=False),
        "lines": Field(_bool, required=False),
    },
    "leave": {
        "job": Field(check_job_name),
        "ep_rank": Field(_int(0, MAX_EP_SIZE - 1)),
        "lease": Field(_ticket),
    },
    "recover": {
        "job": Field(check_job_name),
        "ep_rank": Field(_int(0, MAX_EP_SIZE - 1)),
        "lease": Field(_ticket),
        "timeout": Field(_number(0.0, 86400.0), required=False),
    },
    "renew": {
        "job": Field(check_job_name),
        "ep_rank": Field(_int(0, MAX_EP_SIZE - 1)),
        "lease": Field(_ticket),
        "pid": Field(_int(1, 2**31 - 1)),
        "watch": Field(_tids, required=False),
    },
    "upgrade": {},
    "destroy": {"job": Field(check_job_name)},
    "abort": {"job": Field(check_job_name)},
    "drain": {"enable": Field(_bool, required=False)},
    "shutdown": {"free_jobs": Field(_bool, required=False)},
    "metrics": {},
    "domain": {},
}


@dataclass
class Request:
    type: str
    id: int
    fields: dict[str, Any]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, limit: int = MAX_FRAME) -> Any:
    """Decode one msgpack frame of at most ``limit`` bytes, refusing trailing bytes and absurd
    nesting."""
    if len(data) > limit:
        raise errors.BadMessage(f"frame of {len(data)} bytes exceeds {limit}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=max(4096, limit // 16),
            max_map_len=max(256, limit // 256),
        )
    except errors.A2ADError:
        raise
    except Exception as exc:  # msgpack raises many types for garbage
        raise errors.BadMessage(f"undecodable frame: {type(exc).__name__}") from None


def request_id(obj: Any) -> int:
    """The request id to echo, or -1 when the frame has none usable."""
    if isinstance(obj, dict):
        rid = obj.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**63:
            return rid
    return -1


def parse_request(data: bytes) -> Request:
    """Decode and validate one request frame; raise the A2ADError its reply should carry."""
    obj = unpack(data)
    if not isinstance(obj, dict):
        raise errors.BadMessage("a request must be a map")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise errors.UnsupportedVersion(
            f"protocol version {version!r:.20} is not supported (daemon speaks {PROTOCOL_VERSION})",
            supported=PROTOCOL_VERSION,
        )
    rid = request_id(obj)
    if rid == -1 and "id" in obj:
        raise errors.InvalidField("id must be a 64-bit integer", field="id")
    rtype = obj.get("type")
    if not isinstance(rtype, str) or rtype not in REQUESTS:
        raise errors.UnknownType(f"unknown request type {rtype!r:.40}")
    schema = REQUESTS[rtype]
    extra = [k for k in obj if k not in schema and k not in ("v", "id", "type")]
    if extra:
        raise errors.InvalidField(f"{rtype} has unknown field {extra[0]!r:.40}", field=str(extra[0])[:40])
    fields = {}
    for name, spec in schema.items():
        if name not in obj or obj[name] is None:
            if spec.required:
                raise errors.InvalidField(f"{rtype} needs field {name!r}", field=name)
            continue
        fields[name] = spec.check(name, obj[name])
    if rtype == "join" and fields["ep_rank"] >= fields["ep_size"]:
        raise errors.InvalidField(
            f"ep_rank {fields['ep_rank']} is outside [0, ep_size={fields['ep_size']})", field="ep_rank"
        )
    if rtype == "join" and fields["spec"]["num_experts"] < fields["ep_size"]:
        raise errors.InvalidField(
            f"spec.num_experts ({fields['spec']['num_experts']}) must be >= ep_size ({fields['ep_size']})",
            field="spec.num_experts",
        )
    return Request(type=rtype, id=rid, fields=fields)


def encode_request(rtype: str, rid: int, **fields: Any) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": rid, "type": rtype, **fields})


def encode_reply(rid: int, payload: dict | None = None) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": rid, "ok": True, "code": "ok", "message": "", "payload": payload or {}})


def encode_error(rid: int, err: errors.A2ADError) -> bytes:
    details = {k: v for k, v in err.details.items() if isinstance(v, (int, float, str, bytes, list, bool, type(None)))}
    return pack({"v": PROTOCOL_VERSION, "id": rid, "ok": False, "code": err.code, "message": err.message, "payload": details})


@dataclass
class Reply:
    id: int
    ok: bool
    code: str
    message: str
    payload: dict

    def raise_for_error(self) -> dict:
        if not self.ok:
            raise errors.from_reply(self.code, self.message, self.payload)
        return self.payload


def decode_reply(data: bytes) -> Reply:
    try:
        obj = unpack(data, MAX_REPLY_FRAME)
    except errors.BadMessage as exc:
        raise errors.ProtocolError(f"undecodable reply: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION:
        raise errors.ProtocolError("reply is not a version-1 envelope")
    try:
        reply = Reply(
            id=int(obj["id"]),
            ok=bool(obj["ok"]),
            code=str(obj["code"]),
            message=str(obj["message"]),
            payload=dict(obj.get("payload") or {}),
        )
    except (KeyError, TypeError, ValueError):
        raise errors.ProtocolError("reply envelope is missing fields") from None
    return reply


# --- host-backend row names ---------------------------------------------------
#: A host-backend row shared across the daemons of a domain is a shared-memory object named
#: ``a2ad-<64 hex digits>`` in this folder (the handle is those 32 random bytes).
SHM_DIR_ENV = "A2AD_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
HOST_HANDLE_BYTES = 32


def shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR


def host_handle_path(handle: bytes) -> str:
    """Where the host-backend row named by ``handle`` lives (ValueError for anything that is
    not a handle: the name is built here, never taken from a message)."""
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != HOST_HANDLE_BYTES:
        raise ValueError(f"a host row handle has {HOST_HANDLE_BYTES} bytes")
    return os.path.join(shm_dir(), f"a2ad-{bytes(handle).hex()}")


# --- fd-socket framing --------------------------------------------------------
_LEN = struct.Struct(">I")
FD_FRAME_MAX = 4096


def frame_fd_message(obj: Any) -> bytes:
    body = pack(obj)
    return _LEN.pack(len(body)) + body


def fd_frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > FD_FRAME_MAX:
        raise errors.BadMessage(f"fd-socket frame of {n} bytes exceeds {FD_FRAME_MAX}")
    return n


def normalize_spec(spec: dict, ep_size: int) -> dict:
    """The spec with workspace_size_per_rank filled in (FlashInfer's MoeAlltoAll formula) when only
    per-token byte counts were given, and on_peer_loss when it was left out (a join without
    it asks for the default, so it is compared like any other field)."""
    from .layout import workspace_size_per_rank

    out = dict(spec)
    out.setdefault("on_peer_loss", DEFAULT_PEER_LOSS)
    if "workspace_size_per_rank" not in out:
        out["workspace_size_per_rank"] = workspace_size_per_rank(
            ep_size, out["max_num_tokens"], out["dispatch_bytes_per_token"], out["combine_bytes_per_token"]
        )
    return out
