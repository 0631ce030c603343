"""Each wire verb is defined once (controller/wire/verbs.py), and docs/protocol.md says
what the table says: roles, where each verb runs, its arguments and its result fields."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache.controller.wire.fields import (
    INLINE_MAX_PAGES,
    decode_record,
    encode_record,
    field_names,
)
from hicache.controller.wire.protocol import ProtocolError, Role, Verb
from hicache.controller.wire.verbs import SPECS, HelloArgs, NoArgs, PinArgs, Place, Runs

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
_ROLES = {"engine": {Role.ENGINE}, "admin": {Role.ADMIN}, "both": {Role.ENGINE, Role.ADMIN}}


def _names(cell: str) -> set[str]:
    """The field names a table cell lists: backticked words outside parentheses."""
    return set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", cell)))


def _verb_rows() -> dict[str, list[str]]:
    text = DOC.read_text()
    table = text[text.index("| verb | role | runs on | args | result |") :].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_protocol_doc_lists_every_verb_as_its_spec_defines_it():
    rows = _verb_rows()
    assert set(rows) == {v.value for v in Verb}
    for verb, spec in SPECS.items():
        role, runs, args, result = rows[verb.value]
        assert _ROLES[role] == set(spec.roles), verb
        assert runs.startswith(spec.runs.value), (verb, runs)
        if verb is Verb.HELLO:
            continue  # its arguments and reply have tables of their own
        assert _names(args) == set(field_names(spec.args)), (verb, args)
        if spec.reply is not None:
            assert _names(result) == set(field_names(spec.reply)), (verb, result)


def test_the_handshake_table_lists_every_hello_argument():
    text = DOC.read_text()
    handshake = text[text.index("## Handshake") : text.index("### Admin connections")]
    table = [line for line in handshake.splitlines() if line.startswith("| `")]
    documented = set().union(*(_names(line.split("|")[1]) for line in table))
    assert documented == set(field_names(HelloArgs))
    assert _names(handshake.split("The reply carries")[1]) == set(
        field_names(SPECS[Verb.HELLO].reply)
    )


def test_only_the_verbs_that_address_device_memory_need_a_registration():
    assert {v for v, s in SPECS.items() if s.needs_registration} == {Verb.BACKUP, Verb.LOAD}
    assert {v for v, s in SPECS.items() if s.runs is Runs.IO_OR_LANE} == {Verb.LOOKUP, Verb.PIN}


def test_a_record_round_trips_and_a_bad_field_is_named():
    args = HelloArgs(role="admin", engine_id="ctl", token=b"t" * 16)
    wire = encode_record(args)
    assert wire == {"role": "admin", "engine_id": "ctl", "token": b"t" * 16}
    assert decode_record(HelloArgs, wire, "hello") == args
    with pytest.raises(ProtocolError, match="'ttl_s' must be a number"):
        SPECS[Verb.PIN].decode_args({"keys": {"c": b"", "h": b""}, "ttl_s": "1"})
    with pytest.raises(ProtocolError, match="missing argument 'keys'"):
        decode_record(PinArgs, {"ttl_s": 1.0}, "pin")
    with pytest.raises(ProtocolError, match="unknown argument"):
        decode_record(NoArgs, {"x": 1}, "stats")


def test_the_verb_table_alone_places_each_request():
    """Small lookups run on the I/O thread, large ones on the lane, and with a remote tier
    (the cluster may stall) on a worker; a small load begins on the I/O thread, a large one
    on a worker; admin verbs that touch the disk on a worker."""
    lookup, load = SPECS[Verb.LOOKUP], SPECS[Verb.LOAD]
    small, large = {"hashes": b"h" * 16}, {"hashes": b"h" * 16 * (INLINE_MAX_PAGES + 1)}
    assert lookup.place(small, remote_tier=False) is Place.IO
    assert lookup.place(large, remote_tier=False) is Place.LANE
    assert lookup.place(small, remote_tier=True) is Place.WORKER
    assert load.place({"refs": []}, remote_tier=False) is Place.INLINE_COPY
    assert SPECS[Verb.STATUS].place({}, remote_tier=False) is Place.IO
    assert SPECS[Verb.STATUS].place({}, remote_tier=True) is Place.WORKER
    assert SPECS[Verb.FSCK].place({}, remote_tier=False) is Place.WORKER
    assert SPECS[Verb.PIN].place({}, remote_tier=True) is Place.IO
