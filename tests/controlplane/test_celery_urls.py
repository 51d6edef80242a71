"""A Redis URL with its password in the query (``?password=``) works for Celery too, masked.

redis-py accepts ``redis://host/0?password=...``; Celery's kombu failed on it at start-up with
``TypeError: dict() got multiple values for keyword argument 'password'``, and its banner masks
only a password in the userinfo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kombu.utils.url import maybe_sanitize_url, parse_url

from controlplane.settings import credentials_in_userinfo

ROOT = Path(__file__).resolve().parents[2]


def test_a_query_password_moves_into_the_userinfo():
    assert credentials_in_userinfo("redis://h:6380/2?password=s3cret&health_check_interval=5") == (
        "redis://:s3cret@h:6380/2?health_check_interval=5"
    )
    assert credentials_in_userinfo("rediss://h/0?username=app&password=p%40ss") == "rediss://app:p%40ss@h/0"


def test_urls_without_a_query_password_are_left_alone():
    for url in (
        "redis://127.0.0.1:6379/0",
        "redis://:pw@h/0",
        "redis://:pw@h/0?password=other",
        "redis://h/0?db=1",
    ):
        assert credentials_in_userinfo(url) == url


def test_the_celery_settings_parse_in_kombu_and_mask_the_secret():
    env = {
        **os.environ,
        "REDIS_URL": "redis://127.0.0.1:6379/0?password=s3cret",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    env.pop("CELERY_BROKER_URL", None)
    env.pop("CELERY_RESULT_BACKEND", None)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from django.conf import settings; "
            "print(json.dumps([settings.CELERY_BROKER_URL, settings.CELERY_RESULT_BACKEND, settings.REDIS_URL]))",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    broker, backend, redis_url = json.loads(out.stdout)
    assert redis_url == "redis://127.0.0.1:6379/0?password=s3cret"  # redis-py's own form, as given
    for url in (broker, backend):
        assert parse_url(url)["password"] == "s3cret"  # raised TypeError before
        assert "s3cret" not in maybe_sanitize_url(url)
