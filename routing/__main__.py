"""``python -m routing``: run the gateway (its own HTTP/1.1 server on uvloop + httptools).

Flags override the environment variables of the same meaning (see docs/gateway.md); they are
written back to the environment so every worker process builds the same ``GatewayConfig``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from routing.config import LOG_LEVELS, ConfigError, GatewayConfig
from routing.http.server import run
from routing.redact import MaskingFilter

_FLAGS = {
    "region": "GORGO_REGION",
    "host": "GORGO_GATEWAY_HOST",
    "port": "GORGO_GATEWAY_PORT",
    "workers": "GORGO_GATEWAY_WORKERS",
    "redis_url": "REDIS_URL",
    "redis_prefix": "GORGO_REDIS_PREFIX",
    "gateway_id": "GORGO_GATEWAY_ID",
    "log_level": "LOG_LEVEL",
}


# The help states the defaults the configuration itself holds (an unset region is fine here).
_DEFAULTS = GatewayConfig(region="", gateway_id="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routing", description="gorgo routing gateway")
    parser.add_argument("--region", help="region this gateway serves (GORGO_REGION, required)")
    parser.add_argument("--host", help=f"bind address (GORGO_GATEWAY_HOST, default {_DEFAULTS.host})")
    parser.add_argument(
        "--port", help=f"bind port, 0 for a free one (GORGO_GATEWAY_PORT, default {_DEFAULTS.port})"
    )
    parser.add_argument(
        "--workers", help=f"worker processes (GORGO_GATEWAY_WORKERS, default {_DEFAULTS.workers})"
    )
    parser.add_argument("--redis-url", help="Redis URL (REDIS_URL)")
    parser.add_argument(
        "--redis-prefix", help=f"Redis key prefix (GORGO_REDIS_PREFIX, default {_DEFAULTS.redis_prefix})"
    )
    parser.add_argument("--gateway-id", help="id in request records (GORGO_GATEWAY_ID)")
    parser.add_argument(
        "--log-level", help=f"{'|'.join(LOG_LEVELS)} (LOG_LEVEL, default {_DEFAULTS.log_level})"
    )
    args = parser.parse_args(argv)
    for attribute, variable in _FLAGS.items():
        value = getattr(args, attribute)
        if value is not None:
            os.environ[variable] = str(value)
    try:
        config = GatewayConfig.from_env()
    except ConfigError as exc:
        print(f"gorgo gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(MaskingFilter())  # no URL credentials in any log line
    logging.getLogger("routing").info("starting %r", config)
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
