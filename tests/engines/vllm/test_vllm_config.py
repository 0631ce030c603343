"""kv_connector_extra_config: every hicache_ option parses with its type and default; a
mistyped key or value, or a chunking hicache cannot store, is refused at start."""

from __future__ import annotations

import pytest

from hicache.integrations.vllm import HiCacheConnector, HiCacheVllmConfig
from hicache.types import ConfigError


def test_options_parse_with_their_types_and_defaults() -> None:
    config = HiCacheVllmConfig.from_extra_config(
        {
            "spec_name": "ignored: vLLM's own key",
            "hicache_socket": "/run/hicache/hicache.sock",
            "hicache_lookup_wait_ms": "2.5",
            "hicache_staging_bytes": 1 << 20,
        }
    )
    assert config.socket == "/run/hicache/hicache.sock"
    assert config.lookup_wait_ms == 2.5
    assert config.staging_bytes == 1 << 20 and isinstance(config.staging_bytes, int)
    assert config.lookup_deadline_ms == HiCacheVllmConfig().lookup_deadline_ms
    assert config.layerwise is False  # the whole-block path is the default


@pytest.mark.parametrize(("value", "want"), [(True, True), ("true", True), ("0", False)])
def test_the_layer_wise_switch_takes_a_boolean(value, want) -> None:
    config = HiCacheVllmConfig.from_extra_config({"hicache_layerwise": value})
    assert config.layerwise is want
    assert HiCacheConnector.requires_piecewise_for_cudagraph({"hicache_layerwise": value}) is want


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hicache_lookup_wait": 5}, "unknown kv_connector_extra_config key"),
        ({"hicache_pin_ttl_s": "soon"}, "must be a number"),
        ({"hicache_load_timeout_s": 0}, "must be > 0"),
        ({"hicache_layerwise": "sometimes"}, "must be true or false"),
    ],
)
def test_bad_options_are_refused_naming_the_key(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HiCacheVllmConfig.from_extra_config(extra)
