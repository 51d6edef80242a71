"""Settings for the gorgo control plane, read from the environment only.

Every variable is listed with its default in docker/.env.example and the README. A bad value fails
at start with ImproperlyConfigured, not at 3 a.m.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from routing.env import parse_bool

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse_bool(raw)  # the gateway's spelling too
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={exc}") from None


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


def credentials_in_userinfo(url: str) -> str:
    """``url`` with ``?username=``/``?password=`` moved into its userinfo (``redis://u:p@host``).

    redis-py reads both forms; Celery's kombu fails on the query form with a TypeError (it passes
    the password twice), and its start-up banner masks only a userinfo password. Everything else
    in the URL is kept as it was.
    """
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    found = dict(pairs)
    if "password" not in found or parts.password is not None:
        return url
    user = found.get("username", parts.username or "")
    host = parts.netloc.rpartition("@")[2]
    userinfo = f"{quote(user, safe='')}:{quote(found['password'], safe='')}"
    rest = [(name, value) for name, value in pairs if name not in ("username", "password")]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}", query=urlencode(rest)))


def envlist(name: str, default: str) -> list[str]:
    return [item.strip() for item in envstr(name, default).split(",") if item.strip()]


def generated_secret_key(path: Path) -> str:
    """The key kept in ``path`` (mode 0600), generated on the first start.

    Written to a private temporary file and hard-linked into place, so processes starting at the
    same time all end up with the one key that won, never a half-written one.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(50) + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process was first: use its key
        finally:
            temporary.unlink()
    key = path.read_text().strip()
    if len(key) < 32:
        raise ImproperlyConfigured(f"{path} holds no usable SECRET_KEY; delete it to generate a new one")
    return key


# Development mode (tracebacks in pages, every URL listed on a 404): only with DEBUG=true.
DEBUG = envbool("DEBUG", False)

# Unset: one generated on the first start and kept in var/secret-key (0600). Several web replicas
# on different machines must share one: set SECRET_KEY there.
SECRET_KEY = os.environ.get("SECRET_KEY", "") or generated_secret_key(VAR_DIR / "secret-key")

ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", "http://localhost:8000,http://127.0.0.1:8000")
# true where the web process is reached over HTTPS (a TLS load balancer, docs/deployment.md): the
# browser then never sends the session or CSRF cookie over plain HTTP, where anyone on the path could
# copy it and be signed in. Off by default: `make run` serves http://localhost, where a secure
# cookie would never come back and nobody could sign in.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = envbool("GORGO_SECURE_COOKIES", False)

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
    # Workers, beat and web processes write concurrently. SQLite serves that only like this:
    # WAL (readers never wait for the writer), a busy timeout (a writer waits its turn instead of
    # failing), and IMMEDIATE transactions (a transaction takes the write lock when it begins, so
    # two readers-turned-writers can never deadlock into "database is locked", which no timeout
    # cures). Production fleets should still use PostgreSQL (README, "Configuration").
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )

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
    "drf_spectacular_sidecar",
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

# Password sign-ins through the one backend that throttles failures (controlplane/throttling.py).
AUTHENTICATION_BACKENDS = ["controlplane.throttling.ThrottledModelBackend"]
# This many failed sign-ins or bad API tokens from one address within the window block it until
# the window ends (logins refused, API 429).
GORGO_AUTH_FAILURES = envint("GORGO_AUTH_FAILURES", 10, minimum=1)
GORGO_AUTH_FAILURE_WINDOW_S = envint("GORGO_AUTH_FAILURE_WINDOW_S", 300, minimum=1)
# After Redis failed on an API request's path (sign-in throttle, keys' last-used times), requests
# skip it this long instead of each waiting out the client's timeout (controlplane/connections.py).
GORGO_REDIS_BACKOFF_S = envfloat("GORGO_REDIS_BACKOFF_S", 5.0, minimum=0.1)
# Addresses (or CIDR networks) of the reverse proxies in front of the web process, whose
# X-Forwarded-For is believed for the throttle above; empty: none, the peer address counts. Run
# uvicorn with --no-proxy-headers (our commands do): its default believes X-Forwarded-For from
# 127.0.0.1, so anything on the machine could name a new address per request and never be throttled.
try:
    GORGO_TRUSTED_PROXIES = tuple(
        ipaddress.ip_network(item, strict=False) for item in envlist("GORGO_TRUSTED_PROXIES", "")
    )
except ValueError as exc:
    raise ImproperlyConfigured(f"GORGO_TRUSTED_PROXIES: {exc}") from None

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
        "controlplane.throttling.ThrottledTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.permissions.ViewerReadOperatorWrite"],
    "DEFAULT_FILTER_BACKENDS": [
        "controlplane.filters.FilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    # JSON only: with strict field types a form-encoded body (all strings) could not be typed.
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": envint("API_PAGE_SIZE", 100, minimum=1),
    "DEFAULT_SCHEMA_CLASS": "controlplane.schema.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.api.exception_handler",
}

if REST_FRAMEWORK["PAGE_SIZE"] > 1000:
    raise ImproperlyConfigured("API_PAGE_SIZE must be at most 1000 (the largest page the API serves)")

SPECTACULAR_SETTINGS = {
    "TITLE": "gorgo control plane API",
    "DESCRIPTION": "Regions, GPU nodes, models, routing policies and their published versions.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI from drf-spectacular-sidecar's static files: the docs work without the internet.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{GORGO_REDIS_PREFIX}:asgi"},
    }
}

CELERY_BROKER_URL = credentials_in_userinfo(envstr("CELERY_BROKER_URL", REDIS_URL))
CELERY_RESULT_BACKEND = credentials_in_userinfo(envstr("CELERY_RESULT_BACKEND", REDIS_URL))
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_DEFAULT_QUEUE = envstr("CELERY_TASK_DEFAULT_QUEUE", f"{GORGO_REDIS_PREFIX}.default")
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{GORGO_REDIS_PREFIX}:celery:"}
CELERY_RESULT_EXPIRES = 3600
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    # Passwords in URLs (redis://:pw@host, ?password=) never reach a log line.
    "filters": {"mask_urls": {"()": "routing.redact.MaskingFilter"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["mask_urls"]}
    },
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
# The worker logged two INFO lines per task ("received", "succeeded in"): with probes, scrapes and
# the reconcile every few seconds, ~175 lines a minute that scrolled `make run`'s banner away.
# Failures still log (WARNING and up); beat's one line per due task stays.
LOGGING["loggers"]["celery.app.trace"] = {"level": "WARNING"}
LOGGING["loggers"]["celery.worker.strategy"] = {"level": "WARNING"}
# One OpenAPI enum for the health values used by several telemetry fields.
SPECTACULAR_SETTINGS.setdefault("ENUM_NAME_OVERRIDES", {})["HealthEnum"] = "telemetry.choices.HealthChoices"
# Fleet changes within this many seconds are republished together, as one version that lists
# them (a Celery task); 0 republishes each change at once, in the process that made it.
GORGO_REPUBLISH_DELAY_S = envfloat("GORGO_REPUBLISH_DELAY_S", 2.0, minimum=0.0)
# Bearer token Prometheus sends to the control plane's /metrics; empty: loopback clients only.
GORGO_METRICS_TOKEN = envstr("GORGO_METRICS_TOKEN", "")
# How often what the gateways read from Redis (the policy snapshot, the client key set) is checked
# against the database and written back when Redis lost or missed it (controlplane/reconcile.py).
# A pass that finds everything in place reads a few rows and two keys.
GORGO_RECONCILE_INTERVAL_S = envfloat("GORGO_RECONCILE_INTERVAL_S", 5.0, minimum=1.0)
# Online tuning (docs/routing.md): a window lasts at least GORGO_TUNER_WINDOW_S and holds at least
# GORGO_TUNER_MIN_REQUESTS answered requests routed with the weights under test; a canary trial is
# judged after each window and runs for at most tuner_math.MAX_WINDOWS_PER_TRIAL of them.
GORGO_TUNER_WINDOW_S = envfloat("GORGO_TUNER_WINDOW_S", 300.0, minimum=5.0)
GORGO_TUNER_MIN_REQUESTS = envint("GORGO_TUNER_MIN_REQUESTS", 200, minimum=20)
# Each trial runs as a canary on this share of the sessions (percent, more than 0 and at most 50).
GORGO_TUNER_CANARY_PERCENT = envfloat("GORGO_TUNER_CANARY_PERCENT", 20.0, minimum=0.1)
if GORGO_TUNER_CANARY_PERCENT > 50:
    raise ImproperlyConfigured(
        "GORGO_TUNER_CANARY_PERCENT must be at most 50 (a canary never serves more than half)."
    )
# Shadow and canary (docs/controlplane.md): how often workers sum the request log into the running
# experiments' figures and check the canary (the automatic rollback acts at most this late).
GORGO_EXPERIMENT_INTERVAL_S = envfloat("GORGO_EXPERIMENT_INTERVAL_S", 5.0, minimum=0.2)
# Probe tasks for region R go to queue "probe.R"; everything else to CELERY_TASK_DEFAULT_QUEUE.
# A worker with GORGO_PROBE_REGIONS="*" consumes the probe queue of every region, including ones
# added while it runs; "eu-central,us-east" names the regions it probes from. Empty: only the
# queues given with -Q. Regions nobody consumes are not probed (nothing piles up).
GORGO_PROBE_REGIONS = envstr("GORGO_PROBE_REGIONS", "")
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
    "policies-watch-experiments": {
        "task": "policies.watch_experiments",
        "schedule": GORGO_EXPERIMENT_INTERVAL_S,
        "options": {"expires": GORGO_EXPERIMENT_INTERVAL_S},
    },
    "policies-tune": {
        "task": "policies.tune",
        "schedule": GORGO_TUNER_WINDOW_S / 5,
        "options": {"expires": GORGO_TUNER_WINDOW_S / 5},
    },
}
# --- end Telemetry ---
