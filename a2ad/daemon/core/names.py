"""The fd store's names for a job's descriptors (a row per rank, the control block): what
systemd's fd store accepts, and one name per job and rank and back."""

from __future__ import annotations


#: systemd's FDNAME_MAX: the longest name its fd store accepts.
FDNAME_MAX = 255


# --------------------------------------------------------------------------- names
def fdname_is_valid(name) -> bool:
    """Whether systemd accepts ``name`` as an ``FDNAME=`` (its ``fdname_is_valid()``): ASCII
    from space to ``~`` except ``:``, at most 255 characters. systemd also lets an empty name
    through (it then stores the fd as ``stored``); a name that cannot tell two fds apart is
    no use here, so the empty name is refused too."""
    if not isinstance(name, str) or not name or len(name) > FDNAME_MAX:
        return False
    for ch in name:
        if not " " <= ch <= "~" or ch == ":":
            return False
    return True


def _keep(ch: str) -> bool:
    return "!" <= ch <= "~" and ch not in ":%"


def _encode_job(job: str) -> str:
    out = []
    for ch in job:
        if _keep(ch):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def _decode_job(enc: str) -> str | None:
    """The job name behind an encoded one, or None when ``enc`` is not exactly what
    _encode_job produces (so that each name maps to one job and back)."""
    raw = bytearray()
    i = 0
    while i < len(enc):
        ch = enc[i]
        if ch == "%":
            hexpart = enc[i + 1 : i + 3]
            if len(hexpart) != 2 or any(c not in "0123456789ABCDEF" for c in hexpart):
                return None
            raw.append(int(hexpart, 16))
            i += 3
        elif _keep(ch):
            raw += ch.encode()
            i += 1
        else:
            return None
    try:
        job = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not job or _encode_job(job) != enc:
        return None
    return job


def _rank_of(text: str) -> int | None:
    if not text or not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        return None
    return int(text)


def ws_name(job: str, rank: int) -> str:
    """The store name of job ``job``'s rank ``rank`` workspace row."""
    if not isinstance(job, str) or not job:
        raise ValueError(f"bad job name {job!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"bad rank {rank!r}")
    name = f"ws.{_encode_job(job)}.{rank}"
    if not fdname_is_valid(name):
        raise ValueError(f"job name {job!r} is too long for an fd store name")
    return name


def cb_name(job: str) -> str:
    """The store name of job ``job``'s control block."""
    if not isinstance(job, str) or not job:
        raise ValueError(f"bad job name {job!r}")
    name = f"cb.{_encode_job(job)}"
    if not fdname_is_valid(name):
        raise ValueError(f"job name {job!r} is too long for an fd store name")
    return name


def parse_name(name: str) -> tuple[str, str, int | None] | None:
    """``("ws", job, rank)`` or ``("cb", job, None)`` for a store name, current or legacy
    (``ws:<job>:<rank>``, ``cb:<job>``); None for a name that is neither."""
    if not isinstance(name, str):
        return None
    if name.startswith("ws."):
        enc, sep, rank_text = name[3:].rpartition(".")
        rank = _rank_of(rank_text)
        job = _decode_job(enc) if sep else None
        return None if job is None or rank is None else ("ws", job, rank)
    if name.startswith("cb."):
        job = _decode_job(name[3:])
        return None if job is None else ("cb", job, None)
    if name.startswith("ws:"):
        job, sep, rank_text = name[3:].rpartition(":")
        rank = _rank_of(rank_text)
        return None if not sep or not job or rank is None else ("ws", job, rank)
    if name.startswith("cb:") and len(name) > 3:
        return ("cb", name[3:], None)
    return None


def normalize_name(name: str) -> str | None:
    """The current store name for ``name`` (itself when already current, the translation
    of a legacy ``ws:``/``cb:`` name), or None when it is not one of a2ad's names."""
    parsed = parse_name(name)
    if parsed is None:
        return None
    kind, job, rank = parsed
    try:
        return ws_name(job, rank) if kind == "ws" else cb_name(job)
    except ValueError:
        return None
