"""ControllerConfig: defaults, the LMDB map size rule, and errors that say what to do."""

from __future__ import annotations

import pytest

from hicache.controller.config import MIB, ControllerConfig, DiskWritePolicy
from hicache.types import ConfigError


def test_defaults_write_through_and_size_the_map_for_churn(tmp_path):
    cfg = ControllerConfig(disk_path=tmp_path, disk_budget_bytes=100 * MIB)
    assert cfg.disk_write_policy is DiskWritePolicy.WRITE_THROUGH
    assert cfg.map_size_bytes == 2 * 100 * MIB + 64 * MIB
    assert ControllerConfig().disk_enabled is False


def test_policies_parse_from_strings_and_reject_unknown_values():
    cfg = ControllerConfig(disk_write_policy="write_back", host_pinning="pageable")
    assert cfg.disk_write_policy is DiskWritePolicy.WRITE_BACK
    with pytest.raises(ConfigError, match="disk_write_policy='sometimes' is not one of"):
        ControllerConfig(disk_write_policy="sometimes")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"host_pool_bytes": 0}, "host_pool_bytes must be > 0"),
        ({"host_weight_full": 0}, "host_weight_full must be > 0"),
        ({"host_weight_swa": -1}, "host_weight_swa"),
        ({"host_hit_retention_turnovers": -0.5}, "host_hit_retention_turnovers must be"),
        ({"host_hit_retention_turnovers": float("nan")}, "host_hit_retention_turnovers must be"),
        ({"disk_path": "/x", "disk_budget_bytes": 0}, "disk_budget_bytes must be > 0"),
        (
            {"disk_path": "/x", "disk_budget_bytes": 100 * MIB, "lmdb_map_size_bytes": 110 * MIB},
            "below 1.25 x disk_budget_bytes",
        ),
        ({"reader_threads": 0}, "reader_threads must be >= 1"),
        ({"backup_chunk_bytes": -1}, "backup_chunk_bytes must be >= 0"),
        ({"load_timeout_s": 0}, "load_timeout_s must be > 0 seconds"),
        ({"pin_ttl_default_s": 700.0}, "exceeds pin_ttl_max_s"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ControllerConfig(**overrides)


def test_dict_round_trip_and_unknown_keys(tmp_path):
    cfg = ControllerConfig(disk_path=tmp_path, disk_write_policy="write_back")
    assert ControllerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown controller config key.*host_pool_byte"):
        ControllerConfig.from_dict({"host_pool_byte": 1})
