"""Wire versions: the frozen fixtures of the current major decode to their bodies and are what this build
encodes, byte for byte; every fixture of the previous major is refused with a ``version`` error (before any
MAC check), and a live server answers an old peer in a form that peer reads as a version error."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
from golden_wire import CASES, FIXTURES, MSG_ID, SECRET, SRC, TS, encode, load
from refbus.bus.reqrep import Server
from refbus.protocol import envelope
from refbus.protocol.envelope import PROTOCOL_VERSION, SPOKEN_MAJORS, WireCodec, negotiate
from refbus.protocol.errors import ProtocolError, VersionMismatch
from refbus.protocol.messages import Error, Hello, Keep, Ok

pytest_plugins = ["wire_fixtures"]

CURRENT = PROTOCOL_VERSION[0]
PREVIOUS = CURRENT - 1
SIGNED = [False, True]
WAIT_MS = 5000


def same_body(decoded: Any, expected: Any) -> bool:
    if isinstance(expected, Keep):
        arrays = [{name: a.tolist() for name, a in branch.items()} for branch in decoded.branches]
        wanted = [{name: a.tolist() for name, a in branch.items()} for branch in expected.branches]
        return arrays == wanted and msgspec.structs.replace(decoded, branches=[]) == msgspec.structs.replace(
            expected, branches=[])
    return decoded == expected


@pytest.mark.parametrize("signed", SIGNED, ids=["plain", "signed"])
@pytest.mark.parametrize("case", list(CASES))
def test_current_fixtures_decode_to_their_bodies(case: str, signed: bool) -> None:
    codec = WireCodec("reader", secret=SECRET if signed else b"")
    messages = [codec.decode_body(received) for received in codec.read_events(load(CURRENT, case, signed))]
    body, options = CASES[case]
    count = options.get("batch", 1)
    assert len(messages) == count
    incarnation = MSG_ID.partition("-")[0]
    for n, message in enumerate(messages):
        assert same_body(message.body, body)
        assert (message.header.id, message.header.src, message.header.ts) == (f"{incarnation}-{n + 1}", SRC, TS)
        assert message.header.seq == options.get("seq", 0) + n and message.header.signed is signed


@pytest.mark.parametrize("signed", SIGNED, ids=["plain", "signed"])
@pytest.mark.parametrize("case", list(CASES))
def test_this_build_encodes_the_frozen_bytes(case: str, signed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envelope.time, "time", lambda: TS)
    assert encode(case, signed) == load(CURRENT, case, signed), "the wire changed: bump the version"


@pytest.mark.parametrize("signed", SIGNED, ids=["plain", "signed"])
@pytest.mark.parametrize("case", [case for case in CASES if (FIXTURES / f"wire_v{PREVIOUS}" / f"{case}.json").exists()])
def test_the_previous_major_is_refused_with_a_version_error(case: str, signed: bool) -> None:
    for codec in (WireCodec("reader"), WireCodec("reader", secret=SECRET)):  # version is checked before the MAC
        with pytest.raises(ProtocolError) as info:
            codec.decode(load(PREVIOUS, case, signed))
        assert type(info.value) is VersionMismatch and info.value.code == "version"
        assert str(info.value) == (f"{CASES[case][0].kind}: protocol {PREVIOUS}.0 from {SRC!r}, this node speaks "
                                   f"{CURRENT}.{PROTOCOL_VERSION[1]}")


def read_as_the_previous_major(frames: list[bytes]) -> tuple[list[int], dict[str, Any]]:
    """What a peer of the previous major reads first: at least [kind, header, body], a header map holding its
    required fields; it compares ``v`` before anything else, so this is the version it reports."""
    assert len(frames) >= 3
    header = msgspec.msgpack.decode(frames[1])
    assert {"v", "id", "src", "seq", "ts"} <= set(header)
    return header["v"], msgspec.msgpack.decode(frames[2])


@pytest.mark.parametrize("signed", SIGNED, ids=["plain", "signed"])
def test_a_live_server_answers_an_old_peer_with_a_version_error_it_can_read(
    serve: Any, sockets: Any, signed: bool
) -> None:
    runs: list[str] = []

    def setup(server: Server) -> None:
        server.on("keep", lambda request: runs.append(request.kind) or Ok())

    srv = serve(setup, secret=SECRET if signed else b"")
    dealer = sockets(zmq.DEALER, connect=srv.endpoint)
    dealer.send_multipart(load(PREVIOUS, "keep", signed))
    assert dealer.poll(WAIT_MS)
    frames = dealer.recv_multipart()
    version, body = read_as_the_previous_major(frames)
    assert version == list(PROTOCOL_VERSION)
    assert (body["code"], body["request_kind"]) == ("version", "keep")
    assert f"protocol {PREVIOUS}.0 from {SRC!r}" in body["message"]
    reply = WireCodec("reader", secret=SECRET if signed else b"").decode(frames)
    assert isinstance(reply.body, Error) and reply.header.re == MSG_ID
    assert runs == [] and srv.server.rejected == {"version": 1}


def test_negotiation_picks_a_spoken_major_or_refuses() -> None:
    assert negotiate([]) == CURRENT
    assert negotiate([CURRENT, CURRENT + 1]) == CURRENT
    assert negotiate([CURRENT] * 16) == CURRENT
    for offered in ([PREVIOUS], [CURRENT + 1, CURRENT + 7], [0]):
        with pytest.raises(VersionMismatch, match=rf"^hello: peer speaks protocol majors .*, this node "
                                                  rf"\[{CURRENT}\]$"):
            negotiate(offered)
    assert SPOKEN_MAJORS == (CURRENT,)


@pytest.mark.parametrize("wire", [[-1], [65536], list(range(17)), ["2"], 2, [[2]], [2.5]],
                         ids=["negative", "too-big", "too-many", "string", "not-a-list", "nested", "float"])
def test_garbage_hello_wire_lists_are_schema_errors(wire: Any) -> None:
    codec = WireCodec("hello-sender")
    frames = [bytes(f) for f in codec.encode(CASES["hello"][0])]
    body = msgspec.msgpack.decode(frames[2])
    frames[2] = msgspec.msgpack.encode({**body, "wire": wire})
    with pytest.raises(ProtocolError) as info:
        WireCodec("broker").decode(frames)
    assert info.value.code == "schema" and "wire" in str(info.value)
    assert isinstance(WireCodec("broker").decode([frames[0], frames[1], msgspec.msgpack.encode(
        {**body, "wire": [CURRENT, 9]})]).body, Hello)
