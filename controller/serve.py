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

Sizes accept units (``512MiB``, ``4GiB``, ``1.5GB``). SIGTERM or SIGINT drains: in-flight
requests finish, then every queued backup is committed to LMDB before the process exits.
Logs are one line per event: ``time LEVEL logger: message``.
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
from hicache.controller.sidecar_config import SidecarConfig
from hicache.layout import ModelLayout
from hicache.types import ConfigError, HicacheError

log = logging.getLogger("hicache.sidecar")

DEFAULT_DISK_PATH = "./hicache-data"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")
_NULLABLE = {"disk_path", "lmdb_map_size_bytes", "socket_path", "tcp_endpoint"}


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string with a unit (``4GiB``, ``512MB``, ``1048576``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a size; write e.g. 4GiB, 512MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _coerce(name: str, value: Any, default: Any) -> Any:
    """``value`` (from TOML, the environment or a flag) as the type of field ``name``."""
    if isinstance(value, str) and name in _NULLABLE and value.strip().lower() in ("", "none"):
        return None
    if name.endswith("_bytes"):
        return parse_size(value, name)
    if not isinstance(value, str):
        return value
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={value!r}: use true or false")
    try:
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if isinstance(default, list):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _tomllib() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError(
            "reading a TOML config needs Python 3.11 or newer; use HICACHE_* variables and "
            "flags, or a JSON layout file"
        ) from None
    return tomllib


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


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
    side_def, ctl_def = _defaults(SidecarConfig), _defaults(ControllerConfig)
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
        for table, target, defaults in (
            ("sidecar", side, side_def),
            ("controller", ctl, ctl_def),
        ):
            for k, v in data.get(table, {}).items():
                if k not in defaults:
                    raise ConfigError(f"{path}: unknown key {k!r} in [{table}]")
                target[k] = _coerce(k, v, defaults[k])
        if "layout" in data:
            layout = _layout_from(data["layout"], str(path))
    for target, defaults in ((side, side_def), (ctl, ctl_def)):
        for k in defaults:
            raw = env.get("HICACHE_" + k.upper())
            if raw is not None:
                target[k] = _coerce(k, raw, defaults[k])
    for k, v in (overrides or {}).items():
        if k in side_def:
            side[k] = _coerce(k, v, side_def[k])
        elif k in ctl_def:
            ctl[k] = _coerce(k, v, ctl_def[k])
        else:
            raise ConfigError(
                f"unknown setting {k!r}; settings are the fields of [sidecar] and [controller]"
            )
    if layout_file:
        text = Path(layout_file).read_text()
        if str(layout_file).endswith(".json"):
            table = json.loads(text)
        else:
            table = _tomllib().loads(text)
        layout = _layout_from(table, str(layout_file))
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
    p.add_argument("--lease-s", help="seconds without heartbeats before an engine is dropped")
    p.add_argument("--metrics-port", help="Prometheus port (0: off; default 9464)")
    p.add_argument("--metrics-addr", help="Prometheus address (default 127.0.0.1)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
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
    "lease_s",
    "metrics_port",
    "metrics_addr",
    "log_level",
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
    from hicache.controller.sidecar_config import BackupAck

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
    from hicache.controller.faults import FaultPlan

    return FaultPlan(**json.loads(raw))


def run_serve(args: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM/SIGINT. Exit codes: 0 clean, 1 failed, 2 bad config."""
    import zmq

    from hicache.controller.local import LocalController
    from hicache.controller.server import SidecarError, SidecarServer

    try:
        settings = load_settings(
            args.config, overrides=_overrides(args), layout_file=args.layout_file
        )
        _check_settings(settings)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"hicache serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.sidecar.log_level)
    layout = settings.layout
    try:
        if layout is not None:
            controller = LocalController(settings.controller, layout[0], layout[1])
        else:
            controller = LocalController(settings.controller)
    except HicacheError as exc:
        log.error("cannot start the controller: %s", exc)
        return 1
    controller.faults = _faults_from_env()
    server = SidecarServer(controller, settings.sidecar, layout=layout, own_process=True)
    if controller.opened:
        server.freeze_long_lived()
    metrics_port = 0
    try:
        endpoints = server.bind()
        if settings.sidecar.metrics_port:
            metrics_port = server.metrics.serve_http(
                settings.sidecar.metrics_port, settings.sidecar.metrics_addr
            )
            log.info("metrics on http://%s:%d/metrics", settings.sidecar.metrics_addr, metrics_port)
    except (HicacheError, OSError, SidecarError, zmq.ZMQError) as exc:
        log.error("cannot serve: %s", exc)
        controller.close()
        return 1
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
            },
        )
    try:
        server.serve()
    finally:
        pending = controller.stats().get("disk", {}).get("pending_writes", 0)
        log.info("draining: %s disk writes queued", pending)
        controller.close()
        server.metrics.close()
        log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache.controller.serve`` (the same as ``hicache serve``)."""
    parser = argparse.ArgumentParser(prog="hicache serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
