"""The remote tier's settings reach the controller from every source, and a bad one is a
clear error: ``remote_url`` from TOML, ``HICACHE_REMOTE_URL`` and ``--remote-url``; the
password only from a file; policies as enums; deadlines and sizes checked."""

from __future__ import annotations

import argparse

import pytest

from hicache.controller.config import ControllerConfig, RemoteWritePolicy
from hicache.controller.sidecar.process import _overrides, add_serve_arguments, load_settings
from hicache.controller.tiers.remote_cluster import parse_remote_url, read_password_file
from hicache.types import ConfigError

URL = "redis://10.0.0.5:6379,10.0.0.6:6380"


def test_remote_url_from_toml_environment_and_flag(tmp_path):
    toml = tmp_path / "hicache.toml"
    toml.write_text(
        f'[controller]\nremote_url = "{URL}"\nremote_write_policy = "on_host_eviction"\n'
        "remote_lookup_timeout_s = 0.05\n"
    )
    c = load_settings(toml, env={}).controller
    assert c.remote_url == URL and c.remote_enabled
    assert c.remote_write_policy is RemoteWritePolicy.ON_HOST_EVICTION
    assert c.remote_lookup_timeout_s == 0.05
    env = {"HICACHE_REMOTE_URL": "rediss://hicache@cache:6379"}
    assert load_settings(toml, env=env).controller.remote_url == env["HICACHE_REMOTE_URL"]
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--remote-url", "redis://flag:7000"])
    c = load_settings(toml, env=env, overrides=_overrides(args)).controller
    assert c.remote_url == "redis://flag:7000"  # the flag wins
    assert ControllerConfig().remote_url is None  # off by default


def test_seeds_tls_and_user_are_parsed_from_the_url():
    assert parse_remote_url(URL) == ((("10.0.0.5", 6379), ("10.0.0.6", 6380)), False, None)
    seeds, tls, user = parse_remote_url("rediss://hicache@[::1]:6379")
    assert seeds == (("::1", 6379),) and tls and user == "hicache"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://10.0.0.5:6379", "redis://"),
        ("redis://10.0.0.5", "host:port"),
        ("redis://10.0.0.5:0", "host:port"),
        ("redis://user:secret@10.0.0.5:6379", "remote_password_file"),
    ],
)
def test_a_bad_url_is_refused_saying_why(url, says):
    with pytest.raises(ConfigError, match=says):
        ControllerConfig(remote_url=url)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_lookup_timeout_s", 0),
        ("remote_write_queue_pages", 0),
        ("remote_breaker_failures", 0),
        ("remote_key_prefix", "a{b}"),
        ("remote_write_policy", "sometimes"),
    ],
)
def test_bad_remote_values_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        ControllerConfig(**{field: value})


def test_the_password_comes_from_its_file(tmp_path):
    path = tmp_path / "remote.password"
    path.write_text("s3cret\n")
    assert read_password_file(path) == "s3cret"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_password_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_password_file(tmp_path / "missing")
