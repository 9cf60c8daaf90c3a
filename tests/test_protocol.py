"""The wire protocol on its own: encoding, decoding and every rejection, no sockets."""

import msgpack
import pytest

from a2ad import errors, layout, protocol

SPEC = {"max_num_tokens": 128, "top_k": 8, "num_experts": 256, "dispatch_bytes_per_token": 14400, "combine_bytes_per_token": 14336}


def join(**over):
    fields = dict(job="job-a", ep_rank=1, ep_size=4, spec=dict(SPEC), pid=1234, device="host", timeout=5.0)
    fields.update(over)
    return protocol.encode_request("join", 7, **fields)


def test_join_round_trip():
    req = protocol.parse_request(join())
    assert req.type == "join" and req.id == 7
    assert req.fields["job"] == "job-a" and req.fields["ep_rank"] == 1 and req.fields["spec"] == SPEC
    assert req.fields["timeout"] == 5.0


def test_reply_round_trip():
    data = protocol.encode_reply(9, {"ticket": b"\x01" * 32, "handles": [{"kind": "control"}]})
    rep = protocol.decode_reply(data)
    assert rep.ok and rep.id == 9 and rep.code == "ok"
    assert rep.raise_for_error()["ticket"] == b"\x01" * 32


def test_error_reply_becomes_the_same_exception():
    err = errors.RendezvousTimeout("waited", missing_ranks=[2, 3])
    rep = protocol.decode_reply(protocol.encode_error(4, err))
    assert not rep.ok and rep.code == "rendezvous_timeout"
    with pytest.raises(errors.RendezvousTimeout) as ei:
        rep.raise_for_error()
    assert ei.value.missing_ranks == [2, 3]


def test_every_code_maps_to_its_class():
    for code, cls in errors.CODES.items():
        assert isinstance(errors.from_reply(code, "m"), cls)
    unknown = errors.from_reply("no_such_code", "m")
    assert isinstance(unknown, errors.InternalError) and unknown.details["code"] == "no_such_code"


@pytest.mark.parametrize(
    "data, exc",
    [
        (b"", errors.BadMessage),
        (b"\xc1", errors.BadMessage),  # never-used msgpack byte
        (b"\x93\x01\x02", errors.BadMessage),  # truncated array
        (msgpack.packb([1, 2, 3]), errors.BadMessage),
        (msgpack.packb("join"), errors.BadMessage),
        (msgpack.packb({"v": 2, "id": 1, "type": "hello"}), errors.UnsupportedVersion),
        (msgpack.packb({"id": 1, "type": "hello"}), errors.UnsupportedVersion),
        (msgpack.packb({"v": 1, "id": 1, "type": "launch_missiles"}), errors.UnknownType),
        (msgpack.packb({"v": 1, "id": 1, "type": 5}), errors.UnknownType),
        (msgpack.packb({"v": 1, "id": "x", "type": "hello"}), errors.InvalidField),
        (msgpack.packb({"v": 1, "id": 1, "type": "hello", "extra": 1}), errors.InvalidField),
        (msgpack.packb({1: 2}), errors.BadMessage),  # non-string map key
        (b"\x00" * (protocol.MAX_FRAME + 1), errors.BadMessage),
    ],
)
def test_malformed_frames_are_rejected(data, exc):
    with pytest.raises(exc):
        protocol.parse_request(data)


@pytest.mark.parametrize(
    "over, field",
    [
        ({"job": ""}, "job"),
        ({"job": "a" * 65}, "job"),
        ({"job": "bad name"}, "job"),
        ({"job": "-lead"}, "job"),
        ({"job": 5}, "job"),
        ({"ep_rank": -1}, "ep_rank"),
        ({"ep_rank": 4}, "ep_rank"),  # == ep_size
        ({"ep_rank": True}, "ep_rank"),  # bools are not integers here
        ({"ep_size": 0}, "ep_size"),
        ({"ep_size": 257}, "ep_size"),  # > MAX_EP_SIZE
        ({"ep_size": 2.0}, "ep_size"),
        ({"pid": 0}, "pid"),
        ({"device": ""}, "device"),
        ({"device": "x" * 200}, "device"),
        ({"device": "bad\x00dev"}, "device"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"spec": {**SPEC, "top_k": 0}}, "spec.top_k"),
        ({"spec": {**SPEC, "top_k": 23}}, "spec.top_k"),
        ({"spec": {**SPEC, "num_experts": 3}}, "spec.num_experts"),  # < ep_size
        ({"spec": {**SPEC, "max_num_tokens": 0}}, "spec.max_num_tokens"),
        ({"spec": {**SPEC, "dispatch_bytes_per_token": -5}}, "spec.dispatch_bytes_per_token"),
        ({"spec": {**SPEC, "workspace_size_per_rank": 1 << 50}}, "spec.workspace_size_per_rank"),
        ({"spec": {"max_num_tokens": 8, "top_k": 2, "num_experts": 8}}, "spec.workspace_size_per_rank"),
        ({"spec": {**SPEC, "colour": "red"}}, "spec.colour"),
        ({"spec": "big"}, "spec"),
    ],
)
def test_bad_join_fields_name_the_field(over, field):
    with pytest.raises(errors.InvalidField) as ei:
        protocol.parse_request(join(**over))
    assert ei.value.details["field"] == field, ei.value.message


def test_missing_required_field():
    data = protocol.encode_request("join", 1, job="j", ep_rank=0, ep_size=1, pid=5, device="host")
    with pytest.raises(errors.InvalidField) as ei:
        protocol.parse_request(data)
    assert ei.value.details["field"] == "spec"


def test_every_request_type_has_a_schema_and_parses():
    minimal = {
        "hello": {},
        "status": {},
        "jobs": {},
        "job_info": {"job": "j"},
        "join": dict(job="j", ep_rank=0, ep_size=1, spec=dict(SPEC, num_experts=8), pid=1, device="host"),
        "leave": {"job": "j", "ep_rank": 0, "lease": b"\x00" * 32},
        "recover": {"job": "j", "ep_rank": 0, "lease": b"\x00" * 32},
        "renew": {"job": "j", "ep_rank": 0, "lease": b"\x00" * 32, "pid": 5},
        "upgrade": {},
        "destroy": {"job": "j"},
        "abort": {"job": "j"},
        "drain": {},
        "metrics": {},
        "shutdown": {},
        "domain": {},
    }
    assert set(minimal) == set(protocol.REQUESTS)
    for rtype, fields in minimal.items():
        assert protocol.parse_request(protocol.encode_request(rtype, 3, **fields)).type == rtype


def test_request_id_is_echoed_even_for_bad_requests():
    data = msgpack.packb({"v": 1, "id": 77, "type": "nope"})
    assert protocol.request_id(protocol.unpack(data)) == 77


def test_normalize_spec_uses_the_seed_formula():
    spec = protocol.normalize_spec(SPEC, 4)
    assert spec["workspace_size_per_rank"] == layout.workspace_size_per_rank(4, 128, 14400, 14336)
    expected = layout.pad_up(layout.aux_data_size(4, 128)) + layout.pad_up(4 * 128 * 14400) + layout.pad_up(4 * 128 * 14336)
    assert spec["workspace_size_per_rank"] == expected


def test_fd_frames():
    framed = protocol.frame_fd_message({"v": 1, "ticket": b"t" * 32})
    assert protocol.fd_frame_length(framed[:4]) == len(framed) - 4
    with pytest.raises(errors.BadMessage):
        protocol.fd_frame_length((protocol.FD_FRAME_MAX + 1).to_bytes(4, "big"))


def test_job_names_are_matched_in_full():
    for bad in ("evil\n", "a\nb", "ok\x00", " lead", "x" * 65, ""):
        with pytest.raises(errors.InvalidField):
            protocol.check_job_name("job", bad)
    assert protocol.check_job_name("job", "layer.0:ep-8_a") == "layer.0:ep-8_a"


def test_replies_may_be_larger_than_requests():
    big = protocol.encode_reply(1, {"jobs": ["x" * 1000] * 200})
    assert len(big) > protocol.MAX_FRAME
    assert len(protocol.decode_reply(big).payload["jobs"]) == 200
    with pytest.raises(errors.BadMessage):
        protocol.parse_request(protocol.encode_request("hello", 1, pad="x" * protocol.MAX_FRAME))
