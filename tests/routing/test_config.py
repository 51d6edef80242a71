"""GatewayConfig: every setting from the environment, bad values refused at start."""

from __future__ import annotations

import pytest

from routing.config import ConfigError, GatewayConfig

BASE = {"GORGO_REGION": "eu-central"}


class TestConfig:
    def test_it_has_defaults_for_everything_but_the_region(self):
        config = GatewayConfig.from_env(BASE)
        assert config.region == "eu-central"
        assert config.redis_url == "redis://127.0.0.1:6379/0"
        assert config.redis_prefix == "gorgo"
        assert (config.host, config.port, config.workers) == ("127.0.0.1", 8100, 1)
        assert config.gateway_id  # hostname-pid

    def test_it_requires_a_region(self):
        with pytest.raises(ConfigError, match="GORGO_REGION"):
            GatewayConfig.from_env({})

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("GORGO_GATEWAY_PORT", "http"),
            ("GORGO_GATEWAY_PORT", "70000"),
            ("GORGO_GATEWAY_WORKERS", "0"),
            ("GORGO_MAX_BODY_BYTES", "-5"),
            ("GORGO_UPSTREAM_READ_TIMEOUT_S", "nan"),
            ("LOG_LEVEL", "verbose"),
            ("REDIS_URL", "http://127.0.0.1:6379"),
            ("GORGO_REGION", "eu central"),
        ],
    )
    def test_it_names_the_variable_with_a_bad_value(self, name, value):
        with pytest.raises(ConfigError, match=name):
            GatewayConfig.from_env({**BASE, name: value})

    def test_it_reads_typed_values(self):
        config = GatewayConfig.from_env(
            {
                **BASE,
                "GORGO_GATEWAY_PORT": "0",
                "GORGO_MAX_BODY_BYTES": "2048",
                "GORGO_UPSTREAM_CONNECT_TIMEOUT_S": "0.5",
                "LOG_LEVEL": "WARNING",
                "GORGO_GATEWAY_ID": "gw-a",
            }
        )
        assert (config.port, config.max_body_bytes, config.upstream_connect_timeout_s) == (0, 2048, 0.5)
        assert config.log_level == "warning"
        assert config.gateway_id == "gw-a"

    def test_it_gives_each_worker_its_own_gateway_id(self):
        config = GatewayConfig.from_env({**BASE, "GORGO_GATEWAY_ID": "gw-a", "GORGO_GATEWAY_WORKERS": "4"})
        assert config.gateway_id.startswith("gw-a-") and config.gateway_id != "gw-a"

    def test_it_masks_the_redis_password_in_repr(self):
        config = GatewayConfig.from_env({**BASE, "REDIS_URL": "redis://user:s3cret@redis.example:6380/1"})
        assert "s3cret" not in repr(config)
        assert "redis://user:***@redis.example:6380/1" in repr(config)
        assert config.redis_url.endswith("s3cret@redis.example:6380/1")


def test_it_states_each_default_once_on_the_field_that_holds_it():
    config = GatewayConfig.from_env(BASE)

    assert config == GatewayConfig(region="eu-central", gateway_id=config.gateway_id)
