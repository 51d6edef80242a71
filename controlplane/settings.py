"""Settings for the gorgo control plane, read from the environment only.

Every variable is listed with its default in docker/.env.example and the README. A bad value fails
at start with ImproperlyConfigured, not at 3 a.m.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false)")


def envint(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def envfloat(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def envstr(name: str, default: str) -> str:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else raw


def envlist(name: str, default: str) -> list[str]:
    return [item.strip() for item in envstr(name, default).split(",") if item.strip()]


DEBUG = envbool("DEBUG", False)

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set. Set SECRET_KEY in the environment, or DEBUG=true for a development key."
        )
    SECRET_KEY = "gorgo-insecure-development-key-do-not-use-in-production"

ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", "http://localhost:8000,http://127.0.0.1:8000")

try:
    DATABASES = {
        "default": dj_database_url.parse(
            envstr("DATABASE_URL", f"sqlite:///{VAR_DIR / 'gorgo.sqlite3'}"),
            conn_max_age=envint("DATABASE_CONN_MAX_AGE", 0, minimum=0),
        )
    }
except ValueError as exc:
    raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from None
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Workers, beat and the web process write concurrently; wait instead of failing on a lock.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20

REDIS_URL = envstr("REDIS_URL", "redis://127.0.0.1:6379/0")
GORGO_REDIS_PREFIX = envstr("GORGO_REDIS_PREFIX", "gorgo")
if ":" in GORGO_REDIS_PREFIX or not GORGO_REDIS_PREFIX:
    raise ImproperlyConfigured("GORGO_REDIS_PREFIX must be non-empty and contain no ':'")

LOG_LEVEL = envstr("LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    raise ImproperlyConfigured(f"LOG_LEVEL={LOG_LEVEL!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "channels",
    "controlplane.fleet",
    "controlplane.policies",
    "controlplane.keys",
    "telemetry",
    "controlplane.dashboard",
    "controlplane.demo",  # seed_demo: development-only, the one importer of the simulator
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "dashboard:login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.permissions.ViewerReadOperatorWrite"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": envint("API_PAGE_SIZE", 100, minimum=1),
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.api.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "gorgo control plane API",
    "DESCRIPTION": "Regions, GPU nodes, models, routing policies and their published versions.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{GORGO_REDIS_PREFIX}:asgi"},
    }
}

CELERY_BROKER_URL = envstr("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = envstr("CELERY_RESULT_BACKEND", REDIS_URL)
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_DEFAULT_QUEUE = envstr("CELERY_TASK_DEFAULT_QUEUE", f"{GORGO_REDIS_PREFIX}.default")
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{GORGO_REDIS_PREFIX}:celery:"}
CELERY_RESULT_EXPIRES = 3600
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "INFO"}},
}

# --- Telemetry ---
# RTT probes, vLLM /metrics scrapes, health hysteresis, request-log aggregation (docs/telemetry.md).
GORGO_PROBE_INTERVAL_S = envfloat("GORGO_PROBE_INTERVAL_S", 5.0, minimum=0.2)
GORGO_SCRAPE_INTERVAL_S = envfloat("GORGO_SCRAPE_INTERVAL_S", 5.0, minimum=0.2)
GORGO_AGGREGATE_INTERVAL_S = envfloat("GORGO_AGGREGATE_INTERVAL_S", 10.0, minimum=0.2)
GORGO_PRUNE_INTERVAL_S = envfloat("GORGO_PRUNE_INTERVAL_S", 3600.0, minimum=1.0)
GORGO_PROBE_TIMEOUT_S = envfloat("GORGO_PROBE_TIMEOUT_S", 2.0, minimum=0.05)
GORGO_SCRAPE_TIMEOUT_S = envfloat("GORGO_SCRAPE_TIMEOUT_S", 3.0, minimum=0.05)
GORGO_RAW_RETENTION_H = envfloat("GORGO_RAW_RETENTION_H", 24.0, minimum=0.01)
GORGO_ROLLUP_RETENTION_D = envfloat("GORGO_ROLLUP_RETENTION_D", 30.0, minimum=0.01)
# A node turns unhealthy after this many consecutive failed probes (or scrapes) ...
GORGO_HEALTH_FAILURES = envint("GORGO_HEALTH_FAILURES", 3, minimum=1)
# ... and healthy again after this many consecutive successes of every check.
GORGO_HEALTH_SUCCESSES = envint("GORGO_HEALTH_SUCCESSES", 2, minimum=1)
# Probes and scrapes make several requests a second; httpx would log each one at INFO.
LOGGING["loggers"]["httpx"] = {"level": "WARNING"}
# One OpenAPI enum for the health values used by several telemetry fields.
SPECTACULAR_SETTINGS.setdefault("ENUM_NAME_OVERRIDES", {})["HealthEnum"] = "telemetry.choices.HealthChoices"
# Bearer token Prometheus sends to the control plane's /metrics; empty: loopback clients only.
GORGO_METRICS_TOKEN = envstr("GORGO_METRICS_TOKEN", "")
# How often the active policy is re-checked against Redis (republished if Redis missed a change).
GORGO_RECONCILE_INTERVAL_S = envfloat("GORGO_RECONCILE_INTERVAL_S", 30.0, minimum=1.0)
# Probe tasks for region R go to queue "probe.R"; everything else to CELERY_TASK_DEFAULT_QUEUE.
CELERY_TASK_ROUTES = ("telemetry.tasks.route_task",)
# Each periodic run expires when the next one is due, so a backlog never piles up.
CELERY_BEAT_SCHEDULE = {
    "telemetry-probe-fanout": {
        "task": "telemetry.probe_fanout",
        "schedule": GORGO_PROBE_INTERVAL_S,
        "options": {"expires": GORGO_PROBE_INTERVAL_S},
    },
    "telemetry-scrape": {
        "task": "telemetry.scrape_metrics",
        "schedule": GORGO_SCRAPE_INTERVAL_S,
        "options": {"expires": GORGO_SCRAPE_INTERVAL_S},
    },
    "telemetry-aggregate": {
        "task": "telemetry.aggregate_requests",
        "schedule": GORGO_AGGREGATE_INTERVAL_S,
        "options": {"expires": GORGO_AGGREGATE_INTERVAL_S},
    },
    "telemetry-prune": {
        "task": "telemetry.prune",
        "schedule": GORGO_PRUNE_INTERVAL_S,
        "options": {"expires": GORGO_PRUNE_INTERVAL_S},
    },
    "policies-reconcile": {
        "task": "policies.reconcile",
        "schedule": GORGO_RECONCILE_INTERVAL_S,
        "options": {"expires": GORGO_RECONCILE_INTERVAL_S},
    },
}
# --- end Telemetry ---
