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
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args
from urllib.parse import urlsplit

from routing.env import parse_bool
from routing.redact import mask_url

# LOG_LEVEL is the one log-level variable of every gorgo process (control plane, workers, gateway).
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
OnOff = Literal["on", "off"]


_C = TypeVar("_C", bound=str)


class ConfigError(ValueError):
    """An environment variable has a value the gateway cannot run with."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything one gateway process needs to know, validated."""

    region: str
    gateway_id: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "gorgo"
    host: str = "127.0.0.1"
    port: int = 8100
    workers: int = 1
    log_level: LogLevel = "info"
    max_body_bytes: int = 4 * 1024 * 1024
    request_log_maxlen: int = 100_000
    request_log_pending_max: int = 10_000
    request_log_flush_interval_s: float = 0.05
    upstream_connect_timeout_s: float = 3.0
    upstream_read_timeout_s: float = 600.0
    upstream_keepalive_s: float = 300.0
    live_refresh_interval_s: float = 1.0
    live_stale_s: float = 30.0
    node_down_cooldown_s: float = 5.0
    upstream_first_byte_timeout_s: float = 5.0
    upstream_idle_timeout_s: float = 10.0
    upstream_retries: int = 1
    retry_budget_ratio: float = 0.1
    breaker_failures: int = 5
    breaker_max_open_s: float = 60.0
    client_max_header_bytes: int = 64 * 1024
    client_max_headers: int = 100
    client_header_timeout_s: float = 10.0
    client_body_timeout_s: float = 30.0
    client_keepalive_s: float = 75.0
    max_connections: int = 2048
    admission_factor: float = 2.0
    queue_max_length: int = 512
    queue_max_wait_s: float = 5.0
    auth: OnOff = "on"
    key_refresh_s: float = 5.0
    ratelimit_redis_timeout_s: float = 0.25
    ratelimit_lease_fraction: float = 0.01

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
        workers = reader.integer("GORGO_GATEWAY_WORKERS", 1, minimum=1, maximum=256)
        gateway_id = reader.text("GORGO_GATEWAY_ID", "")
        if not gateway_id:
            gateway_id = f"{socket.gethostname()}-{os.getpid()}"
        elif workers > 1:
            # Each worker process is a gateway of its own (own in-flight counts, own share of
            # the load exchange), so each needs its own id.
            gateway_id = f"{gateway_id}-{os.getpid()}"
        if not region:
            raise ConfigError("GORGO_REGION is required: the region this gateway serves (e.g. eu-west)")
        config = cls(
            region=region,
            gateway_id=gateway_id,
            redis_url=reader.text("REDIS_URL", "redis://127.0.0.1:6379/0"),
            redis_prefix=reader.text("GORGO_REDIS_PREFIX", "gorgo"),
            host=reader.text("GORGO_GATEWAY_HOST", "127.0.0.1"),
            port=reader.integer("GORGO_GATEWAY_PORT", 8100, minimum=0, maximum=65535),
            workers=workers,
            log_level=reader.choice("LOG_LEVEL", "info", LOG_LEVELS),
            max_body_bytes=reader.integer("GORGO_MAX_BODY_BYTES", 4 * 1024 * 1024, minimum=1024),
            request_log_maxlen=reader.integer("GORGO_REQUEST_LOG_MAXLEN", 100_000, minimum=1),
            request_log_pending_max=reader.integer("GORGO_REQUEST_LOG_PENDING_MAX", 10_000, minimum=1),
            request_log_flush_interval_s=reader.number(
                "GORGO_REQUEST_LOG_FLUSH_INTERVAL_S", 0.05, minimum=0.001
            ),
            upstream_connect_timeout_s=reader.number("GORGO_UPSTREAM_CONNECT_TIMEOUT_S", 3.0, minimum=0.001),
            upstream_read_timeout_s=reader.number("GORGO_UPSTREAM_READ_TIMEOUT_S", 600.0, minimum=0.001),
            upstream_keepalive_s=reader.number("GORGO_UPSTREAM_KEEPALIVE_S", 300.0, minimum=1.0),
            live_refresh_interval_s=reader.number("GORGO_LIVE_REFRESH_INTERVAL_S", 1.0, minimum=0.05),
            live_stale_s=reader.number("GORGO_LIVE_STALE_S", 30.0, minimum=0.1),
            node_down_cooldown_s=reader.number("GORGO_NODE_DOWN_COOLDOWN_S", 5.0, minimum=0.0),
            upstream_first_byte_timeout_s=reader.number(
                "GORGO_UPSTREAM_FIRST_BYTE_TIMEOUT_S", 5.0, minimum=0.001
            ),
            upstream_idle_timeout_s=reader.number("GORGO_UPSTREAM_IDLE_TIMEOUT_S", 10.0, minimum=0.001),
            upstream_retries=reader.integer("GORGO_UPSTREAM_RETRIES", 1, minimum=0, maximum=5),
            retry_budget_ratio=reader.number("GORGO_RETRY_BUDGET_RATIO", 0.1, minimum=0.0),
            breaker_failures=reader.integer("GORGO_BREAKER_FAILURES", 5, minimum=1),
            breaker_max_open_s=reader.number("GORGO_BREAKER_MAX_OPEN_S", 60.0, minimum=0.1),
            client_max_header_bytes=reader.integer("GORGO_CLIENT_MAX_HEADER_BYTES", 64 * 1024, minimum=1024),
            client_max_headers=reader.integer("GORGO_CLIENT_MAX_HEADERS", 100, minimum=10),
            client_header_timeout_s=reader.number("GORGO_CLIENT_HEADER_TIMEOUT_S", 10.0, minimum=0.1),
            client_body_timeout_s=reader.number("GORGO_CLIENT_BODY_TIMEOUT_S", 30.0, minimum=0.1),
            client_keepalive_s=reader.number("GORGO_CLIENT_KEEPALIVE_S", 75.0, minimum=0.1),
            max_connections=reader.integer("GORGO_MAX_CONNECTIONS", 2048, minimum=1),
            admission_factor=reader.number("GORGO_ADMISSION_FACTOR", 2.0, minimum=0.0),
            queue_max_length=reader.integer("GORGO_QUEUE_MAX_LENGTH", 512, minimum=0),
            queue_max_wait_s=reader.number("GORGO_QUEUE_MAX_WAIT_S", 5.0, minimum=0.0),
            auth="on" if reader.flag("GORGO_AUTH", True) else "off",
            key_refresh_s=reader.number("GORGO_KEY_REFRESH_S", 5.0, minimum=0.1),
            ratelimit_redis_timeout_s=reader.number("GORGO_RATELIMIT_REDIS_TIMEOUT_S", 0.25, minimum=0.001),
            ratelimit_lease_fraction=reader.number("GORGO_RATELIMIT_LEASE_FRACTION", 0.01, minimum=0.0),
        )
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
