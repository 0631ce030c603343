"""The disk tier holds pages derived from users' prompts: it is private whatever the
umask, a directory others may write is refused at start, and fsck checks every value
even before any engine has registered (issue 17's probe)."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from hicache.controller.admin.ops import fsck
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.types import ConfigError
from tests.support.controller import FULL, PAGE, controller_config, registered_controller


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_disk_tier_is_private_under_umask_022(tmp_path, umask_022):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(2 * PAGE))
    assert ctl.backup(chain.refs([FULL])).wait(10)
    assert ctl.flush(10.0)
    disk = tmp_path / "lmdb"
    assert _mode(disk) == 0o700
    files = sorted(disk.iterdir())
    assert {f.name for f in files} >= {"data.mdb", "lock.mdb"}
    for f in files:
        assert _mode(f) == 0o600, f"{f.name} is {_mode(f):04o}"
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_disk_path_others_can_write_is_refused_at_start(tmp_path, mode):
    disk = tmp_path / "lmdb"
    disk.mkdir()
    os.chmod(disk, mode)
    with pytest.raises(ConfigError, match="other users may write"):
        LocalController(controller_config(tmp_path))


def test_a_file_others_can_write_in_the_disk_path_is_refused(tmp_path):
    disk = tmp_path / "lmdb"
    disk.mkdir(mode=0o700)
    (disk / "data.mdb").touch()
    os.chmod(disk / "data.mdb", 0o666)
    with pytest.raises(ConfigError, match=r"data\.mdb"):
        LocalController(controller_config(tmp_path))


def test_a_disk_path_others_can_read_is_served_with_a_warning(tmp_path, caplog):
    disk = tmp_path / "lmdb"
    disk.mkdir()
    os.chmod(disk, 0o755)
    with caplog.at_level(logging.WARNING, logger="hicache.security"):
        ctl = LocalController(controller_config(tmp_path))
    assert "readable by other users" in caplog.text
    ctl.close()


def test_fsck_on_a_fresh_start_finds_every_corrupt_value(tmp_path):
    """No engine has registered since the start: the tiers are not open, and fsck still
    reads every value; every corrupted one is found (and repaired on request), the
    layout left unchecked; a registration afterwards finds the sound ones."""
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(8 * PAGE))
    assert ctl.backup(chain.refs([FULL])).wait(10)
    ctl.close()
    keys = [r.key.storage_key() for r in chain.refs([FULL])]
    corrupted = set(keys[1::3])

    import lmdb

    env = lmdb.open(str(tmp_path / "lmdb"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        stored = txn.stat()["entries"]
        for i, key in enumerate(sorted(corrupted)):
            value = bytearray(txn.get(key))
            value[HEADER_BYTES + 7 * i + 1] ^= 0x08  # the payload: the checksum catches it
            txn.put(key, bytes(value))
    env.close()

    fresh = LocalController(controller_config(tmp_path))
    assert not fresh.opened
    found = fsck(fresh)
    sound = stored - len(corrupted)
    assert (found.checked, found.corrupt, found.ok) == (stored, len(corrupted), sound)
    assert found.layout_unchecked == found.ok
    repaired = fsck(fresh, repair=True)
    assert repaired.repaired == len(corrupted)
    assert fsck(fresh).corrupt == 0
    fresh.register(layout, PAGE, engine.pools)
    tiers = fresh.store.tiers_of([r.key for r in chain.refs([FULL])])
    assert [bool(t) for t in tiers] == [k not in corrupted for k in keys]
    fresh.check_invariants(deep=True)
    fresh.close()
