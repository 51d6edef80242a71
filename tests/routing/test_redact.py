"""Credentials in URLs never reach a log line, in the gateway's logs and the control plane's."""

from __future__ import annotations

import logging
import sys

import pytest

from routing.redact import MaskingFilter, mask_url, mask_urls


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://h/0?password=s3cret", "redis://h/0?password=***"),
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        (
            "rediss://user:s3cret@[::1]:6379/0?db=1&password=s3cret",
            "rediss://user:***@[::1]:6379/0?db=1&password=***",
        ),
        ("postgres://app:s3cret@db/gorgo", "postgres://app:***@db/gorgo"),
        ("http://127.0.0.1:8101/metrics", "http://127.0.0.1:8101/metrics"),
    ],
)
def test_it_masks_passwords_in_userinfo_and_query(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_it_masks_every_url_in_a_message_and_its_traceback() -> None:
    try:
        raise ConnectionError("Error connecting to redis://:s3cret@10.0.0.5:6379/0")
    except ConnectionError:
        record = logging.LogRecord(
            "x", logging.WARNING, __file__, 1, "publish failed for %s", ("redis://h/0?password=s3cret",), None
        )
        record.exc_info = sys.exc_info()
    MaskingFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "s3cret" not in text
    assert "redis://h/0?password=***" in text and "redis://:***@10.0.0.5:6379/0" in text
    assert mask_urls("no urls here") == "no urls here"


def test_the_control_plane_console_log_masks_urls(settings) -> None:
    console = settings.LOGGING["handlers"]["console"]
    assert "mask_urls" in console["filters"]
    assert settings.LOGGING["filters"]["mask_urls"]["()"] == "routing.redact.MaskingFilter"
