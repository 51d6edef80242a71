"""Gateway configuration: one frozen dataclass, built once from the environment.

Every setting is an environment variable (``python -m routing`` flags just set them), listed with
its default in docs/gateway.md. A bad value raises ``ConfigError`` at start, naming the variable,
instead of surfacing as a confusing failure under load.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args
from urllib.parse import urlsplit

from routing.contract import RedisKeys
from routing.env import parse_bool
from routing.redact import mask_url

# LOG_LEVEL is the one log-level variable of every gorgo process (control plane, workers, gateway).
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
OnOff = Literal["on", "off"]


_C = TypeVar("_C", bound=str)


class ConfigError(ValueError):
    """An environment variable has a value the gateway cannot run with."""


def _env(variable: str, *, minimum: float | None = None, maximum: int | None = None) -> dict[str, Any]:
    """A setting's field metadata: the variable it is read from and its bounds (its default is the
    field's own, so each setting is stated once)."""
    return {"env": variable, "minimum": minimum, "maximum": maximum}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything one gateway process needs to know, validated."""

    region: str
    gateway_id: str
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=_env("REDIS_URL"))
    # The contract's own default prefix: a gateway and a control plane left unset agree.
    redis_prefix: str = field(default=RedisKeys().prefix, metadata=_env("GORGO_REDIS_PREFIX"))
    host: str = field(default="127.0.0.1", metadata=_env("GORGO_GATEWAY_HOST"))
    port: int = field(default=8100, metadata=_env("GORGO_GATEWAY_PORT", minimum=0, maximum=65535))
    workers: int = field(default=1, metadata=_env("GORGO_GATEWAY_WORKERS", minimum=1, maximum=256))
    log_level: LogLevel = field(default="info", metadata=_env("LOG_LEVEL"))
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata=_env("GORGO_MAX_BODY_BYTES", minimum=1024))
    request_log_maxlen: int = field(default=100_000, metadata=_env("GORGO_REQUEST_LOG_MAXLEN", minimum=1))
    request_log_pending_max: int = field(
        default=10_000, metadata=_env("GORGO_REQUEST_LOG_PENDING_MAX", minimum=1)
    )
    request_log_flush_interval_s: float = field(
        default=0.05, metadata=_env("GORGO_REQUEST_LOG_FLUSH_INTERVAL_S", minimum=0.001)
    )
    upstream_connect_timeout_s: float = field(
        default=3.0, metadata=_env("GORGO_UPSTREAM_CONNECT_TIMEOUT_S", minimum=0.001)
    )
    upstream_read_timeout_s: float = field(
        default=600.0, metadata=_env("GORGO_UPSTREAM_READ_TIMEOUT_S", minimum=0.001)
    )
    upstream_keepalive_s: float = field(
        default=300.0, metadata=_env("GORGO_UPSTREAM_KEEPALIVE_S", minimum=1.0)
    )
    live_refresh_interval_s: float = field(
        default=1.0, metadata=_env("GORGO_LIVE_REFRESH_INTERVAL_S", minimum=0.05)
    )
    live_stale_s: float = field(default=30.0, metadata=_env("GORGO_LIVE_STALE_S", minimum=0.1))
    node_down_cooldown_s: float = field(default=5.0, metadata=_env("GORGO_NODE_DOWN_COOLDOWN_S", minimum=0.0))
    upstream_first_byte_timeout_s: float = field(
        default=5.0, metadata=_env("GORGO_UPSTREAM_FIRST_BYTE_TIMEOUT_S", minimum=0.001)
    )
    upstream_idle_timeout_s: float = field(
        default=10.0, metadata=_env("GORGO_UPSTREAM_IDLE_TIMEOUT_S", minimum=0.001)
    )
    upstream_retries: int = field(default=1, metadata=_env("GORGO_UPSTREAM_RETRIES", minimum=0, maximum=5))
    retry_budget_ratio: float = field(default=0.1, metadata=_env("GORGO_RETRY_BUDGET_RATIO", minimum=0.0))
    breaker_failures: int = field(default=5, metadata=_env("GORGO_BREAKER_FAILURES", minimum=1))
    breaker_max_open_s: float = field(default=60.0, metadata=_env("GORGO_BREAKER_MAX_OPEN_S", minimum=0.1))
    client_max_header_bytes: int = field(
        default=64 * 1024, metadata=_env("GORGO_CLIENT_MAX_HEADER_BYTES", minimum=1024)
    )
    client_max_headers: int = field(default=100, metadata=_env("GORGO_CLIENT_MAX_HEADERS", minimum=10))
    client_header_timeout_s: float = field(
        default=10.0, metadata=_env("GORGO_CLIENT_HEADER_TIMEOUT_S", minimum=0.1)
    )
    client_body_timeout_s: float = field(
        default=30.0, metadata=_env("GORGO_CLIENT_BODY_TIMEOUT_S", minimum=0.1)
    )
    client_keepalive_s: float = field(default=75.0, metadata=_env("GORGO_CLIENT_KEEPALIVE_S", minimum=0.1))
    client_send_timeout_s: float = field(
        default=30.0, metadata=_env("GORGO_CLIENT_SEND_TIMEOUT_S", minimum=0.1)
    )
    shutdown_grace_s: float = field(default=30.0, metadata=_env("GORGO_SHUTDOWN_GRACE_S", minimum=0.0))
    max_connections: int = field(default=2048, metadata=_env("GORGO_MAX_CONNECTIONS", minimum=1))
    max_connections_per_address: int = field(
        default=256, metadata=_env("GORGO_MAX_CONNECTIONS_PER_ADDRESS", minimum=1)
    )
    admission_factor: float = field(default=2.0, metadata=_env("GORGO_ADMISSION_FACTOR", minimum=0.0))
    queue_max_length: int = field(default=512, metadata=_env("GORGO_QUEUE_MAX_LENGTH", minimum=0))
    queue_max_wait_s: float = field(default=5.0, metadata=_env("GORGO_QUEUE_MAX_WAIT_S", minimum=0.0))
    auth: OnOff = field(default="on", metadata=_env("GORGO_AUTH"))
    key_refresh_s: float = field(default=5.0, metadata=_env("GORGO_KEY_REFRESH_S", minimum=0.1))
    ratelimit_redis_timeout_s: float = field(
        default=0.25, metadata=_env("GORGO_RATELIMIT_REDIS_TIMEOUT_S", minimum=0.001)
    )
    ratelimit_lease_fraction: float = field(
        default=0.01, metadata=_env("GORGO_RATELIMIT_LEASE_FRACTION", minimum=0.0)
    )

    def __repr__(self) -> str:  # the URL may carry a password
        shown = ", ".join(
            f"{name}={getattr(self, name)!r}" for name in self.__dataclass_fields__ if name != "redis_url"
        )
        return f"GatewayConfig(redis_url={mask_url(self.redis_url)!r}, {shown})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """Build and validate the configuration from ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        reader = _EnvReader(env)
        region = reader.text("GORGO_REGION", "")
        workers = reader.setting(_FIELDS["workers"])
        gateway_id = reader.text("GORGO_GATEWAY_ID", "")
        if not gateway_id:
            gateway_id = f"{socket.gethostname()}-{os.getpid()}"
        elif workers > 1:
            # Each worker process is a gateway of its own (own in-flight counts, own share of
            # the load exchange), so each needs its own id.
            gateway_id = f"{gateway_id}-{os.getpid()}"
        if not region:
            raise ConfigError("GORGO_REGION is required: the region this gateway serves (e.g. eu-west)")
        settings = {
            item.name: reader.setting(item)
            for item in fields(cls)
            if "env" in item.metadata and item.name != "workers"
        }
        config = cls(region=region, gateway_id=gateway_id, workers=workers, **settings)
        scheme = urlsplit(config.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"REDIS_URL must start with redis://, rediss:// or unix://, got {scheme!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", config.region):
            raise ConfigError(
                f"GORGO_REGION must be a region slug (letters, digits, - and _), got {config.region!r}"
            )
        return config


@dataclass(frozen=True, slots=True)
class _EnvReader:
    """Tiny typed readers: each names the variable in its error."""

    env: Mapping[str, str]

    def setting(self, item: Field[Any]) -> Any:
        """The value of one ``GatewayConfig`` field, read as its type says."""
        name, default = item.metadata["env"], item.default
        minimum, maximum = item.metadata["minimum"], item.metadata["maximum"]
        if item.type == "int":
            return self.integer(name, default, minimum=int(minimum), maximum=maximum)
        if item.type == "float":
            return self.number(name, default, minimum=minimum)
        if item.type == "LogLevel":
            return self.choice(name, default, LOG_LEVELS)
        if item.type == "OnOff":
            return "on" if self.flag(name, default == "on") else "off"
        return self.text(name, default)

    def text(self, name: str, default: str) -> str:
        return self.env.get(name, "").strip() or default

    def integer(self, name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        raw = self.env.get(name, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise ConfigError(f"{name} must be {bound}, got {value}")
        return value

    def number(self, name: str, default: float, *, minimum: float) -> float:
        raw = self.env.get(name, "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {raw!r}") from None
        if not value >= minimum:  # also rejects NaN
            raise ConfigError(f"{name} must be >= {minimum}, got {raw}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        raw = self.env.get(name, "").strip()
        if not raw:
            return default
        try:
            return parse_bool(raw)  # the control plane's spelling too
        except ValueError as exc:
            raise ConfigError(f"{name}={exc}") from None

    def choice(self, name: str, default: _C, choices: tuple[_C, ...]) -> _C:
        raw = self.env.get(name, "").strip().lower() or default
        for choice in choices:
            if raw == choice:
                return choice
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")


_FIELDS = {item.name: item for item in fields(GatewayConfig)}
