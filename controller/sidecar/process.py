"""``hicache serve``: run the sidecar (controller + ZeroMQ server + metrics endpoint).

Configuration comes from, lowest precedence first:

1. defaults, which work with no configuration at all: the Unix socket
   ``$XDG_RUNTIME_DIR/hicache/hicache.sock`` (or ``<tmp>/hicache-<uid>/``) with mode 0600,
   LMDB in ``./hicache-data``, a 1 GiB host pool, metrics on 127.0.0.1:9464;
2. a TOML file (``--config`` or ``$HICACHE_CONFIG``) with the tables ``[sidecar]``
   (:class:`SidecarConfig`), ``[controller]`` (:class:`ControllerConfig`) and an optional
   ``[layout]`` (a :class:`ModelLayout` plus ``page_size``: the layout served, fixed at
   start; without it the first engine's handshake fixes it);
3. environment variables ``HICACHE_<FIELD>`` for any field of the first two tables,
   e.g. ``HICACHE_HOST_POOL_BYTES=8GiB``, ``HICACHE_METRICS_PORT=0``;
4. flags (``--host-pool-bytes``, ``--set field=value``, …), which win.

Every value is checked against its field's type, and an unknown key or ``HICACHE_*``
variable is an error, so a typo never passes silently. Sizes accept units (``512MiB``,
``4GiB``, ``1.5GB``). SIGTERM or SIGINT drains: in-flight requests finish, then every
queued backup is committed to LMDB before the process exits. Logs are one line per event:
``time LEVEL logger: message``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from hicache.controller.config import ControllerConfig
from hicache.controller.settings import coerce, did_you_mean, fields_of, parse_size
from hicache.controller.sidecar.config import SidecarConfig
from hicache.layout import ModelLayout
from hicache.types import ConfigError, HicacheError

log = logging.getLogger("hicache.sidecar")

DEFAULT_DISK_PATH = "./hicache-data"

# Exit codes of ``hicache serve`` (docs/operations.md lists them).
EXIT_STOPPED = 0  # stopped on SIGTERM/SIGINT with every queued disk write committed
EXIT_FAILED = 1  # could not start: the controller, a socket or the metrics endpoint
EXIT_BAD_CONFIG = 2  # a bad configuration: stopped before anything was touched
EXIT_WRITES_LOST = 3  # stopped, but acknowledged pages did not reach disk

# HICACHE_* variables that are not options: this module's (HICACHE_CONFIG, HICACHE_FAULTS),
# the clients' (HICACHE_ENDPOINT, often set in the sidecar's environment too), and those of
# the test suite and CI (tests/, .ci/run). Any other HICACHE_* variable is a typo.
OTHER_VARIABLES = frozenset(
    {
        "HICACHE_CONFIG",
        "HICACHE_FAULTS",
        "HICACHE_ENDPOINT",
        "HICACHE_REQUIRE_PROMETHEUS",
        "HICACHE_REQUIRE_REDIS",
        "HICACHE_HYPOTHESIS_PROFILE",
        "HICACHE_SOAK_EXAMPLES",
        "HICACHE_SOAK_STEPS",
        "HICACHE_ENGINE_SOAK_EXAMPLES",
    }
)
_SERVICE_LINK = re.compile(r"HICACHE\w*_(SERVICE_HOST|SERVICE_PORT\w*|PORT_\d+_(TCP|UDP|SCTP)\w*)")
_SERVICE_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://", re.IGNORECASE)
_SIDECAR_FIELDS = fields_of(SidecarConfig)
_CONTROLLER_FIELDS = fields_of(ControllerConfig)

__all__ = ["ServeSettings", "load_settings", "main", "parse_size", "run_serve"]


def _variable(option: str) -> str:
    return "HICACHE_" + option.upper()


def _tomllib() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError(
            "reading a TOML config needs Python 3.11 or newer; use HICACHE_* variables and "
            "flags, or a JSON layout file"
        ) from None
    return tomllib


@dataclasses.dataclass
class ServeSettings:
    """Everything ``hicache serve`` runs with, after merging all sources."""

    sidecar: SidecarConfig
    controller: ControllerConfig
    layout: tuple[ModelLayout, int] | None = None


def _layout_from(table: dict[str, Any], source: str) -> tuple[ModelLayout, int]:
    d = dict(table)
    if "page_size" not in d:
        raise ConfigError(f"{source}: the layout table needs page_size")
    page_size = d.pop("page_size")
    if type(page_size) is not int or page_size < 1:
        raise ConfigError(f"{source}: page_size must be an integer >= 1")
    try:
        return ModelLayout.from_dict(d), page_size
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{source}: bad layout ({exc})") from None


def load_settings(
    config_file: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
    layout_file: str | os.PathLike | None = None,
) -> ServeSettings:
    """Merge defaults, the TOML file, ``HICACHE_*`` variables and ``overrides`` (flags).

    Raises ConfigError naming the source and the bad value.
    """
    env = dict(os.environ) if env is None else env
    side: dict[str, Any] = {}
    ctl: dict[str, Any] = {"disk_path": DEFAULT_DISK_PATH}
    layout = None
    path = config_file or env.get("HICACHE_CONFIG")
    if path:
        tomllib = _tomllib()
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        unknown = set(data) - {"sidecar", "controller", "layout"}
        if unknown:
            raise ConfigError(
                f"{path}: unknown table(s) {sorted(unknown)}; use [sidecar], [controller], [layout]"
            )
        for table, target, fields in (
            ("sidecar", side, _SIDECAR_FIELDS),
            ("controller", ctl, _CONTROLLER_FIELDS),
        ):
            for k, v in data.get(table, {}).items():
                if k not in fields:
                    raise ConfigError(
                        f"{path}: unknown key {k!r} in [{table}]{did_you_mean(k, fields)}"
                    )
                target[k] = coerce(k, v, fields[k], f"{path} [{table}]")
        if "layout" in data:
            layout = _layout_from(data["layout"], str(path))
    options = _SIDECAR_FIELDS.keys() | _CONTROLLER_FIELDS.keys()
    for var, raw in sorted(env.items()):
        if not var.startswith("HICACHE_") or var in OTHER_VARIABLES:
            continue
        if _SERVICE_LINK.fullmatch(var) or _SERVICE_LINK_VALUE.match(raw):
            # Kubernetes sets these for a Service named hicache* in the pod's namespace
            # (HICACHE_METRICS_PORT=tcp://10.0.0.7:9464 for "hicache-metrics"): not ours.
            log.debug("ignoring $%s, a Kubernetes service link", var)
            continue
        k = var.removeprefix("HICACHE_").lower()
        if var != _variable(k) or k not in options:
            hint = did_you_mean(k, options, _variable) or "; correct it or unset it"
            raise ConfigError(
                f"${var} is not an option (HICACHE_<OPTION> sets a field of [sidecar] or "
                f"[controller]){hint}"
            )
        target, fields = (
            (side, _SIDECAR_FIELDS) if k in _SIDECAR_FIELDS else (ctl, _CONTROLLER_FIELDS)
        )
        target[k] = coerce(k, raw, fields[k], f"${var}")
    for k, v in (overrides or {}).items():
        if k in _SIDECAR_FIELDS:
            side[k] = coerce(k, v, _SIDECAR_FIELDS[k], "command line")
        elif k in _CONTROLLER_FIELDS:
            ctl[k] = coerce(k, v, _CONTROLLER_FIELDS[k], "command line")
        else:
            raise ConfigError(
                f"unknown setting {k!r} (settings are the fields of [sidecar] and "
                f"[controller]){did_you_mean(k, options)}"
            )
    if layout_file:
        text = Path(layout_file).read_text()
        if str(layout_file).endswith(".json"):
            table = json.loads(text)
        else:
            table = _tomllib().loads(text)
        layout = _layout_from(table, str(layout_file))
    ctl.setdefault("host_shared", True)  # the engines copy their load-backs themselves
    ctl.setdefault("host_populate", True)  # ready means ready: no first touch at a load
    ctl.setdefault("prewarm_bytes", None)  # a warm start: half the host pool, hottest first
    ctl.setdefault("prewarm_disk_bytes", None)  # and the OS cache: a host pool's worth more
    return ServeSettings(SidecarConfig(**side), ControllerConfig(**ctl), layout)


class OneLineFormatter(logging.Formatter):
    """``time LEVEL logger: message``, with any newline (tracebacks too) folded."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hicache serve`` (they override the config file and environment)."""
    p = parser
    p.add_argument("--config", help="TOML config file (default: $HICACHE_CONFIG)")
    p.add_argument("--socket", dest="socket_path", help="Unix socket path")
    p.add_argument("--tcp", dest="tcp_endpoint", help="also serve TCP, e.g. tcp://0.0.0.0:5557")
    p.add_argument("--tcp-auth", choices=["curve", "token"], help="TCP authentication")
    p.add_argument("--tcp-token-file", help="file holding the TCP token (tcp-auth token)")
    p.add_argument("--host-pool-bytes", help="host tier size, e.g. 8GiB")
    p.add_argument("--disk-path", help="LMDB directory (default ./hicache-data)")
    p.add_argument("--no-disk", action="store_true", help="run without a disk tier")
    p.add_argument("--disk-budget-bytes", help="disk tier budget, e.g. 100GiB")
    p.add_argument("--backup-ack", choices=["host", "disk"], help="when backups are acknowledged")
    p.add_argument("--tenant-host-quota-bytes", help="each tenant's host quota, e.g. 4GiB")
    p.add_argument("--tenant-disk-quota-bytes", help="each tenant's disk quota, e.g. 64GiB")
    p.add_argument(
        "--remote-url",
        help="remote tier: Valkey/Redis Cluster seeds, redis://host:port[,host:port...] "
        "(rediss:// for TLS)",
    )
    p.add_argument("--lease-s", help="seconds without heartbeats before an engine is dropped")
    p.add_argument("--metrics-port", help="Prometheus port (0: off; default 9464)")
    p.add_argument("--metrics-addr", help="Prometheus address (default 127.0.0.1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--kv-events-endpoint",
        help="publish KV events in vLLM's format on this PUB endpoint, e.g. tcp://*:5557",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        help="answer KV event replays for late subscribers here (ROUTER), e.g. tcp://*:5558",
    )
    p.add_argument("--layout-file", help="the served layout (JSON or TOML, with page_size)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any [sidecar] or [controller] field, e.g. --set reader_threads=8",
    )
    p.add_argument("--ready-file", help="write endpoints and ports here (JSON) once serving")


_FLAG_FIELDS = (
    "socket_path",
    "tcp_endpoint",
    "tcp_auth",
    "tcp_token_file",
    "host_pool_bytes",
    "disk_path",
    "disk_budget_bytes",
    "backup_ack",
    "tenant_host_quota_bytes",
    "tenant_disk_quota_bytes",
    "remote_url",
    "lease_s",
    "metrics_port",
    "metrics_addr",
    "log_level",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: write FIELD=VALUE")
        out[key.strip()] = value.strip()
    for name in _FLAG_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    if args.no_disk:
        out["disk_path"] = "none"
    return out


def _write_ready(path: str, info: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def _check_settings(s: ServeSettings) -> None:
    from hicache.controller.config import DiskWritePolicy
    from hicache.controller.sidecar.config import BackupAck

    if s.sidecar.backup_ack is BackupAck.DISK and (
        not s.controller.disk_enabled
        or s.controller.disk_write_policy is not DiskWritePolicy.WRITE_THROUGH
    ):
        raise ConfigError(
            "backup_ack='disk' needs a disk tier with disk_write_policy='write_through'"
        )


def _faults_from_env() -> Any:
    """A fault plan from ``$HICACHE_FAULTS`` (JSON), for tests only."""
    raw = os.environ.get("HICACHE_FAULTS")
    if not raw:
        return None
    from hicache.controller.store.faults import FaultPlan

    return FaultPlan(**json.loads(raw))


def _start_kv_events(server: Any, config: SidecarConfig) -> Any:
    """Start the KV event publisher, tell it what the tiers hold now (the disk rebuilt at
    start), and make it the store's listener and a source of metrics."""
    from hicache.controller.sidecar.kv_events import KvEventPublisher

    def page_size() -> int:
        served = server.sessions.served
        return served.page_size if served is not None else 0

    publisher = KvEventPublisher(config, page_size)
    server.controller.store.listen(publisher)
    server.metrics.registry.register(publisher.collector())
    log.info("KV events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint)
    return publisher


def run_serve(args: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM/SIGINT; returns one of the ``EXIT_*`` codes."""
    import zmq

    from hicache.controller.sidecar.server import SidecarError, SidecarServer
    from hicache.controller.store.local import LocalController

    try:
        settings = load_settings(
            args.config, overrides=_overrides(args), layout_file=args.layout_file
        )
        _check_settings(settings)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"hicache serve: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    setup_logging(settings.sidecar.log_level)
    layout = settings.layout
    try:
        if layout is not None:
            controller = LocalController(settings.controller, layout[0], layout[1])
        else:
            controller = LocalController(settings.controller)
    except HicacheError as exc:
        log.error("cannot start the controller: %s", exc)
        return EXIT_FAILED
    controller.faults = _faults_from_env()
    server = SidecarServer(controller, settings.sidecar, layout=layout, own_process=True)
    if controller.opened:
        server.freeze_long_lived()
    metrics_port = 0
    publisher = None
    try:
        endpoints = server.bind()
        if settings.sidecar.kv_events_endpoint:
            publisher = _start_kv_events(server, settings.sidecar)
        if settings.sidecar.metrics_port:
            metrics_port = server.metrics.serve_http(
                settings.sidecar.metrics_port, settings.sidecar.metrics_addr
            )
            log.info("metrics on http://%s:%d/metrics", settings.sidecar.metrics_addr, metrics_port)
    except (HicacheError, OSError, SidecarError, zmq.ZMQError) as exc:
        log.error("cannot serve: %s", exc)
        controller.close()
        return EXIT_FAILED
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    log.info(
        "sidecar pid %d serving: host pool %d bytes, disk %s, backup ack %s",
        os.getpid(),
        settings.controller.host_pool_bytes,
        settings.controller.disk_path or "off",
        settings.sidecar.backup_ack.value,
    )
    if args.ready_file:
        _write_ready(
            args.ready_file,
            {
                "pid": os.getpid(),
                "endpoints": endpoints,
                "metrics_port": metrics_port,
                "admin_token_file": str(settings.sidecar.admin_token_path),
                "kv_events": publisher.endpoint if publisher else None,
                "kv_events_replay": publisher.replay_endpoint if publisher else None,
            },
        )
    try:
        server.serve()
    finally:
        pending = controller.stats().get("disk", {}).get("pending_writes", 0)
        log.info("draining: %s disk writes queued", pending)
        lost = controller.close()
        if publisher is not None:
            publisher.close()
        server.metrics.close()
        if lost:
            log.error(
                "%d acknowledged pages did not reach disk and are lost (see the errors above)",
                lost,
            )
        log.info("stopped")
    return EXIT_WRITES_LOST if lost else EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache.controller.sidecar.process`` (the same as ``hicache serve``)."""
    parser = argparse.ArgumentParser(prog="hicache serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
