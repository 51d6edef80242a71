"""One spelling of boolean environment values for every gorgo process (issue 21).

The control plane's ``envbool`` and the gateway's ``GORGO_AUTH`` used to disagree: ``DEBUG=yes``
worked, ``GORGO_AUTH=false`` stopped the gateway. Both now read ``routing.env.parse_bool``.
"""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings import envbool
from routing.config import ConfigError, GatewayConfig

WORDS = [
    ("1", True),
    ("true", True),
    ("Yes", True),
    (" on ", True),
    ("0", False),
    ("FALSE", False),
    ("no", False),
    ("off", False),
]


@pytest.mark.parametrize(("raw", "expected"), WORDS)
def test_it_reads_every_word_the_same_in_the_gateway_and_the_control_plane(raw, expected, monkeypatch):
    monkeypatch.setenv("GORGO_TEST_FLAG", raw)
    config = GatewayConfig.from_env({"GORGO_REGION": "eu-central", "GORGO_AUTH": raw})

    assert envbool("GORGO_TEST_FLAG", not expected) is expected
    assert config.auth == ("on" if expected else "off")


def test_it_refuses_the_same_nonsense_in_both_naming_the_variable(monkeypatch):
    monkeypatch.setenv("GORGO_TEST_FLAG", "maybe")

    with pytest.raises(ImproperlyConfigured, match="GORGO_TEST_FLAG"):
        envbool("GORGO_TEST_FLAG", False)
    with pytest.raises(ConfigError, match="GORGO_AUTH"):
        GatewayConfig.from_env({"GORGO_REGION": "eu-central", "GORGO_AUTH": "maybe"})


def test_it_keeps_the_default_when_unset_or_empty(monkeypatch):
    monkeypatch.setenv("GORGO_TEST_FLAG", "")

    assert envbool("GORGO_TEST_FLAG", True) is True
    assert GatewayConfig.from_env({"GORGO_REGION": "eu-central", "GORGO_AUTH": ""}).auth == "on"
