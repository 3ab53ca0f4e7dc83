"""Settings for iotqueue, read from the environment (12-factor).

Settings fail closed: DEBUG is off unless asked for, and without DEBUG nothing starts
without a real SECRET_KEY and ALLOWED_HOSTS. The dev stack and the test suite set DEBUG=true,
and with it every other value has a development default so `make run` works on a bare
machine; production sets DATABASE_URL, REDIS_URL, MQTT_URL, SECRET_KEY and ALLOWED_HOSTS.
"""

import importlib.util
import os
import warnings
from datetime import timedelta
from pathlib import Path

import environ
from django.core.checks.security import base as security_checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _

BASE_DIR = Path(__file__).resolve().parent.parent
# Runtime files of the dev stack (SQLite database, server logs); never committed. Importing
# the settings writes nothing (a read-only root file system must do): the SQLite backend
# creates the directory, for its owner only, when it first opens the database in it
# (iotqueue/backends/sqlite3/base.py); the dev stack when it writes its logs.
VAR_DIR = BASE_DIR / "var"

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=False)
# Published in this repository, so it signs nothing outside DEBUG; earlier releases used it
# as the default everywhere, so it is refused by name too.
DEV_SECRET_KEY = "dev-only-insecure-key-change-me"
SECRET_KEY = env("SECRET_KEY", default=DEV_SECRET_KEY if DEBUG else "")
# Earlier keys (comma-separated), still accepted when checking a signature while a rotation
# lasts, so that rotating SECRET_KEY signs nobody out; remove a key once sessions signed with
# it have expired (docs/operations.md#accounts-tokens-and-logs).
SECRET_KEY_FALLBACKS = env.list("SECRET_KEY_FALLBACKS", default=[])
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "testserver"] if DEBUG else [])


def _secret_key_refusal(key: str) -> str:
    """Why `key` may not sign sessions and tokens in production ("" when it may).

    The bar is Django's own deploy check (security.W009), so a key that passes here passes
    `check --deploy` too.
    """
    if not key:
        return "SECRET_KEY is not set"
    if key == DEV_SECRET_KEY or key.startswith(security_checks.SECRET_KEY_INSECURE_PREFIX):
        return "SECRET_KEY is a published development key"
    min_length = security_checks.SECRET_KEY_MIN_LENGTH
    min_unique = security_checks.SECRET_KEY_MIN_UNIQUE_CHARACTERS
    if len(key) < min_length:
        return f"SECRET_KEY has fewer than {min_length} characters"
    if len(set(key)) < min_unique:
        return f"SECRET_KEY has fewer than {min_unique} distinct characters"
    return ""


if not DEBUG:
    if refusal := _secret_key_refusal(SECRET_KEY):
        raise ImproperlyConfigured(
            f"{refusal}. With DEBUG off, set SECRET_KEY to a long random value, e.g. "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(50))' (or DEBUG=true for development)."
        )
    for _number, _fallback in enumerate(SECRET_KEY_FALLBACKS, start=1):
        if refusal := _secret_key_refusal(_fallback):
            raise ImproperlyConfigured(
                f"SECRET_KEY_FALLBACKS, key {_number}: {refusal.replace('SECRET_KEY', 'it')}. A fallback "
                "is a former SECRET_KEY, as long and random as one must be (or leave it out)."
            )
    if not ALLOWED_HOSTS:
        raise ImproperlyConfigured(
            "ALLOWED_HOSTS is not set. With DEBUG off, set it to the comma-separated host names "
            "the web server answers to (or DEBUG=true for development)."
        )

# --- HTTPS and cookies -----------------------------------------------------------------
# Production defaults assume TLS in front of gunicorn (a proxy or load balancer); each can be
# set from the environment. DEBUG's defaults keep plain-HTTP runserver usable.
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=not DEBUG)
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=not DEBUG)
# HSTS: browsers refuse plain HTTP for this long after one HTTPS visit; a year is the
# usual production value (and what the HSTS preload list asks for). 0 sends no header.
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0 if DEBUG else 365 * 24 * 3600)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=not DEBUG)
# Preloading asks browser vendors to hard-code HTTPS for the whole registered domain, every
# subdomain included, and takes months to undo: the domain owner's decision, so opt-in.
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
# "HTTP_X_FORWARDED_PROTO,https" behind a TLS-terminating proxy that sets that header (and
# strips it from clients): Django then knows the request came over HTTPS. Unset otherwise,
# or any client could claim HTTPS.
SECURE_PROXY_SSL_HEADER = tuple(env.list("SECURE_PROXY_SSL_HEADER", default=[])) or None
if SECURE_PROXY_SSL_HEADER is not None and len(SECURE_PROXY_SSL_HEADER) != 2:
    raise ImproperlyConfigured(
        "SECURE_PROXY_SSL_HEADER must be 'HEADER,value', e.g. HTTP_X_FORWARDED_PROTO,https"
    )
# Origins (scheme://host) allowed to POST forms, e.g. https://iotqueue.example.com when
# a proxy serves the site under another host or port than the one Django sees.
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
# security.W021 is SECURE_HSTS_PRELOAD being off: see above, it is left to the domain owner.
SILENCED_SYSTEM_CHECKS = ["security.W021"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    # Swagger UI and Redoc as the project's own static files: the API docs work offline.
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "iotqueue",
    "devices",
    "jobs",
    "triggers",
    "webhooks",
    # Development tooling (simulate, demo): present in a checkout, left out of the runtime image.
    *(["devtools"] if importlib.util.find_spec("devtools") else []),
    "axes",  # admin login lockout; last, so its admin pages sit after the project's
]

MIDDLEWARE = [
    # First: /healthz and /readyz are answered before the HTTPS redirect and the host check
    # (iotqueue/probes.py), so a load balancer or kubelet can probe the pod's own address.
    "iotqueue.probes.ProbeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's CSS and JavaScript, the live run view) from gunicorn itself,
    # after `collectstatic` (the image runs it); runserver serves them in development.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "iotqueue.api.NulRefusingMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # The page's language: the one picked in the admin header (set_language, kept in a
    # cookie), else the browser's Accept-Language (zh-CN is Simplified Chinese), else English.
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: answers a locked-out login with AXES_HTTP_RESPONSE_CODE.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "iotqueue.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # Before every app's templates: django.contrib.admin comes first in INSTALLED_APPS,
        # so an override of its admin/base_site.html (the language switcher) must live here.
        "DIRS": [BASE_DIR / "iotqueue" / "templates"],
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

WSGI_APPLICATION = "iotqueue.wsgi.application"

# SQLite by default; PostgreSQL in production via DATABASE_URL=postgres://...
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Bridge, workers and web write concurrently: WAL, and a wait of up to `timeout` for
    # the write lock, keep SQLite from failing with "database is locked" under the dev
    # stack's modest load. The project's backend waits by polling every 0.5 ms rather than
    # with SQLite's backing-off busy handler (iotqueue/backends/sqlite3/base.py).
    DATABASES["default"]["ENGINE"] = "iotqueue.backends.sqlite3"
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            # WAL with synchronous=NORMAL: a commit is not fsynced (a checkpoint is), which
            # is still safe from corruption and loses no commit to a process crash; only a
            # power cut can lose the last ones. Production runs PostgreSQL.
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
    # The test database is a file, not memory: the worker and bridge processes share it.
    # One per test session (pid), so two suites on one checkout never share it.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}
# Connections are reused (workers and bridge run thousands of short transactions; opening
# one per task or message costs more than the step's own statements), checked before use.
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# django-axes first: it refuses a locked-out username and address before any password check.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Admin (and token endpoint) login lockout: after this many failed logins of one username
# from one address, that pair is refused for the cool-off; a success clears the count.
# Username and address together: locking an address alone would let one attacker behind a
# shared proxy lock everybody out, a username alone would let anyone lock out the admin.
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.float("AXES_COOLOFF_MINUTES", default=15.0))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# And one address is locked out after this many failed logins of any usernames within the
# cool-off (iotqueue/throttling.py): trying a few passwords on many usernames (password
# spraying) stops there, while a shared proxy's address still allows many people a typo.
IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT = env.int("IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT", default=10)
AXES_HANDLER = "iotqueue.throttling.AddressLimitedLockoutHandler"
# A login refused by a lockout is answered as one (429) and not counted again: the lockout
# ends a cool-off after it began, however often the locked-out client keeps trying.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = True
# No "AXES: BEGIN ..." banner at every process start (manage.py commands, workers): a lockout
# is still logged, naming its username and address (the lockout parameters).
AXES_VERBOSE = False
AXES_HTTP_RESPONSE_CODE = 429
# The client address as the API throttles see it (REST_FRAMEWORK's NUM_PROXIES).
AXES_CLIENT_IP_CALLABLE = "iotqueue.throttling.client_address"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en"
# The languages the console, the API's messages and the CLI speak (docs/operations.md#languages).
# The catalogue is locale/<language>/LC_MESSAGES/django.po, compiled at install.
LANGUAGES = [("en", _("English")), ("zh-hans", _("Simplified Chinese"))]
LOCALE_PATHS = [BASE_DIR / "locale"]
TIME_ZONE = env("TIME_ZONE", default="UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
if DEBUG:
    # Absent until collectstatic (the image runs it); in development WhiteNoise serves the
    # files from the apps (WHITENOISE_USE_FINDERS follows DEBUG), so its warning says nothing.
    warnings.filterwarnings("ignore", message="No directory at: ")

# API input limits (iotqueue/api.py, iotqueue/jsondepth.py). JSON nested deeper than this,
# in a request body, a stored JSON field or a device message, is refused with a 400 (or
# dropped with an event): Python's JSON code recurses per level and fails near a thousand,
# and no real body needs more than a handful. Bodies larger than DATA_UPLOAD_MAX_MEMORY_SIZE
# (Django's 2.5 MB by default) are refused with a 413, JSON ones included.
IOTQUEUE_JSON_MAX_DEPTH = env.int("IOTQUEUE_JSON_MAX_DEPTH", default=32)
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("DATA_UPLOAD_MAX_MEMORY_SIZE", default=2_621_440)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["iotqueue.permissions.ModelPermissions"],
    "DEFAULT_PAGINATION_CLASS": "iotqueue.pagination.Pagination",
    "DEFAULT_PARSER_CLASSES": [
        "iotqueue.api.NulRefusingJSONParser",
        "iotqueue.api.NulRefusingFormParser",
        "iotqueue.api.NulRefusingMultiPartParser",
    ],
    # DRF's handler, plus 409 for deleting what is still referenced and for unique-name
    # races, and 413 for oversized bodies: an answer in JSON, never a 500.
    "EXCEPTION_HANDLER": "iotqueue.api_errors.api_exception_handler",
    # drf-spectacular's, documenting every operation's error answers (iotqueue/openapi.py).
    "DEFAULT_SCHEMA_CLASS": "iotqueue.openapi.ErrorDocumentingAutoSchema",
    # Rate limits (iotqueue/throttling.py), counted atomically in REDIS_URL's Redis so that
    # every web process shares them and concurrent requests are all counted. Writes: per
    # user, generous (a script starting runs one by one stays under it; a runaway loop does
    # not). Token: per client address, tight enough to make password guessing slow and loud.
    "DEFAULT_THROTTLE_CLASSES": ["iotqueue.throttling.WriteRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {
        "write": env("IOTQUEUE_API_WRITE_RATE", default="1200/min"),
        "token": env("IOTQUEUE_API_TOKEN_RATE", default="10/min"),
    },
    # Proxies in front of the web server that append to X-Forwarded-For: with 0 the client
    # address is REMOTE_ADDR, and a client cannot pick its own address with that header.
    "NUM_PROXIES": env.int("IOTQUEUE_NUM_PROXIES", default=0),
}
SPECTACULAR_SETTINGS = {
    "TITLE": "iotqueue API",
    "DESCRIPTION": "Devices, job templates and runs: start, follow and cancel jobs on IoT devices over MQTT.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Request bodies as their own components (no read-only fields, "required" as the server
    # means it): what generated clients need to send a body without hand edits.
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "iotqueue.openapi.schema_refine",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "jobs.models.RunStatus",
        "StepStatusEnum": "jobs.models.StepStatus",
    },
    # /api/docs/ and /api/docs/redoc/ load their scripts from our static files, not a CDN,
    # so they work on a network without internet (drf-spectacular-sidecar).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Request limits ------------------------------------------------------------------------
# What one write may ask for; over a limit the answer is 400 naming the field and the limit.
# Steps per template: each write validates every step and each run copies them all into its
# plan; hand-written procedures stay far below, and a fleet is one fan-out step, not a step
# per device.
IOTQUEUE_TEMPLATE_MAX_STEPS = env.int("IOTQUEUE_TEMPLATE_MAX_STEPS", default=200)
# Devices one for_each start may select: it creates a run per device within the request.
# More than this is a rollout, which a fan-out step paces (rollout_per_minute, max_in_flight).
IOTQUEUE_FOR_EACH_MAX_DEVICES = env.int("IOTQUEUE_FOR_EACH_MAX_DEVICES", default=500)
# Devices one fan-out step may address: its rows are written in one transaction when it
# starts, and counted on every device's reply. A step matching more fails at once.
IOTQUEUE_FANOUT_MAX_DEVICES = env.int("IOTQUEUE_FANOUT_MAX_DEVICES", default=100_000)
# Devices a fan-out's per-device values may list in a later step's args ({{ steps.NAME.results }},
# .errors, .succeeded, .failed): a command carries values, not a fleet inventory, and the
# context is read for every step that references it. Past it the step fails naming the
# setting; counts (.counts) and targeting by outcome (devices_from) have no such bound.
IOTQUEUE_STEP_RESULTS_MAX_DEVICES = env.int("IOTQUEUE_STEP_RESULTS_MAX_DEVICES", default=1_000)
# A run's parameters as compact JSON: stored on the run and rendered into every step's args;
# like a device reply (IOTQUEUE_MAX_PAYLOAD_BYTES), values, not documents.
IOTQUEUE_RUN_PARAMETERS_MAX_BYTES = env.int("IOTQUEUE_RUN_PARAMETERS_MAX_BYTES", default=64 * 1024)
# The most a rendered step's args may take as JSON (a command's body, and what its row and
# the run's API answer carry). {{ references }} repeat values: 500 references to a 60 KB
# parameter rendered 30 MB. 256 KB is four times the largest device message we accept.
IOTQUEUE_COMMAND_MAX_BYTES = env.int("IOTQUEUE_COMMAND_MAX_BYTES", default=256 * 1024)

# --- Redis: Celery broker and device locks -------------------------------------------
REDIS_URL = env("REDIS_URL", default="redis://127.0.0.1:6379/0")
# Django's cache, shared by every process (the API's throttles count in this Redis with a
# script of their own, iotqueue/throttling.py); the backend reads REDIS_URL and the key
# prefix when first used (iotqueue/cache.py), so it follows them.
CACHES = {"default": {"BACKEND": "iotqueue.cache.ProjectRedisCache"}}

# The device locks and the deadline sets (iotqueue/redis_conn.py): empty = REDIS_URL's server;
# `redis+cluster://host:port` (`rediss+cluster://` with TLS) = a Redis Cluster, any node of it.
LOCK_REDIS_URL = env("LOCK_REDIS_URL", default="")
# Shards of the lock space: a device's lock keys, and the lease index, arrival counter, epoch
# and deadline set they are written with, share one hash tag per shard (devices/locks.py).
# Changing it renames every lock key: the locks are rebuilt from the database, as after a
# Redis loss (docs/operations.md#locks-on-a-redis-cluster).
IOTQUEUE_LOCK_SHARDS = env.int("IOTQUEUE_LOCK_SHARDS", default=16)
if IOTQUEUE_LOCK_SHARDS < 1:
    raise ImproperlyConfigured("IOTQUEUE_LOCK_SHARDS must be at least 1")

# Urgent preemption (docs/orchestration.md#urgent-preemption): a step marked `urgent` whose
# run's priority (0..9) is at least this may take a busy device from a lower-priority run's
# command in flight, which is canceled on the device and queued again. Unset or "none": no
# step ever preempts. Anything else than 0..9 or none refuses to start (fails closed).
_PREEMPT_PRIORITY = env("IOTQUEUE_PREEMPT_PRIORITY", default="").strip().lower()
if _PREEMPT_PRIORITY in ("", "none"):
    IOTQUEUE_PREEMPT_PRIORITY = None
elif _PREEMPT_PRIORITY.isdigit() and int(_PREEMPT_PRIORITY) <= 9:
    IOTQUEUE_PREEMPT_PRIORITY = int(_PREEMPT_PRIORITY)
else:
    raise ImproperlyConfigured(
        f"IOTQUEUE_PREEMPT_PRIORITY must be a priority 0..9 or 'none', not {_PREEMPT_PRIORITY!r}"
    )

CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=REDIS_URL)
# Results are stored only by tasks that ask (CELERY_TASK_IGNORE_RESULT below): chords and
# AsyncResult of canvas device commands (jobs/canvas.py) need a backend; Redis is it.
CELERY_RESULT_BACKEND = env("CELERY_RESULT_BACKEND", default=REDIS_URL)
CELERY_TASK_IGNORE_RESULT = True
# Tests give each session its own queue so a shared Redis never mixes their tasks.
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default="celery")
# Tasks that wait on the outside world (a webhook's HTTP call, SMTP) go to their own queue,
# consumed by their own worker (`celery -A iotqueue worker -Q iotqueue-io`), so the engine's
# tasks never wait behind them (iotqueue/celery.py io_route; docs/operations.md#queues).
IOTQUEUE_IO_QUEUE = env("IOTQUEUE_IO_QUEUE", default="iotqueue-io")
IOTQUEUE_IO_TASKS = ("webhooks.deliver", "webhooks.failed_run_mail", "webhooks.wave_gate")
CELERY_TASK_ROUTES = ("iotqueue.celery.io_route",)
# Task events on, so `celery events` and Flower show what runs (docs/operations.md#celerys-own-tools).
CELERY_WORKER_SEND_TASK_EVENTS = env.bool("IOTQUEUE_CELERY_EVENTS", default=True)
CELERY_TASK_SEND_SENT_EVENT = CELERY_WORKER_SEND_TASK_EVENTS
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Task modules beyond the apps' tasks.py, comma-separated: imported by the worker, and by the
# web process before it checks a template's task steps (jobs/tasksteps.py).
CELERY_IMPORTS = env.list("CELERY_IMPORTS", default=[])
# A task is acknowledged only after it ran, and comes back if its worker dies: every
# step task is idempotent on (step, attempt, fence), so a second execution is harmless.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Step tasks publish and return in milliseconds; anything running 30 s is stuck.
CELERY_TASK_SOFT_TIME_LIMIT = env.int("CELERY_TASK_SOFT_TIME_LIMIT", default=30)
CELERY_TASK_TIME_LIMIT = env.int("CELERY_TASK_TIME_LIMIT", default=60)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Off: in Celery 5.7 it makes a worker that loses Redis cancel work it could finish
# (celery#7185, #9250); our tasks are idempotent and short, so letting them run is safer.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
# Unacked tasks of a killed worker come back after this long; the monitor, not
# redelivery, is what rescues a run, so it may be generous.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT", default=300)}
# Celery's Django fixup closes the database connection around every task unless this is
# set; a step costs a few milliseconds, so a reconnect per task (PostgreSQL: a new backend)
# would dominate. Connections are recycled every N tasks and checked before each one.
CELERY_DB_REUSE_MAX = env.int("CELERY_DB_REUSE_MAX", default=200)
# django-celery-beat's DatabaseScheduler behind a lease in Redis (iotqueue/beat_lease.py):
# any number of beats may run, one schedules and the others stand by.
CELERY_BEAT_SCHEDULER = "iotqueue.beat_lease:LeasedDatabaseScheduler"
# The beat lease's length: the holder renews it every third of this; a standby takes over
# within about this long after the holder died (at once after a clean stop).
IOTQUEUE_BEAT_LEASE_SECONDS = env.float("IOTQUEUE_BEAT_LEASE_SECONDS", default=10.0)
# The monitor tick (timeouts, retries, lease reclaim); its period bounds how late a
# deadline fires. The jobs app registers the tick and retention with beat (jobs/beat.py).
IOTQUEUE_MONITOR_INTERVAL = env.float("IOTQUEUE_MONITOR_INTERVAL", default=1.0)
# How often the monitor sweeps the database for work Redis lost (a killed worker's task,
# a Redis restart); a lost step is rescued within about this long.
IOTQUEUE_RECONCILE_SECONDS = env.float("IOTQUEUE_RECONCILE_SECONDS", default=30.0)
# Lease of a holder that was handed a device's lock, until its dispatch extends it: how
# long a hand-off lost with a killed worker keeps the device idle.
IOTQUEUE_HANDOFF_LEASE_SECONDS = env.float("IOTQUEUE_HANDOFF_LEASE_SECONDS", default=60.0)
# A run is stuck (the dashboard's list, jobs/waiting.py runs_stuck) when its oldest unfinished
# step has waited longer than this: five minutes is past any hand-off, retry or flow-control
# pause of a healthy fleet, and short enough to catch an offline device before its queue timeout.
IOTQUEUE_STUCK_AFTER_SECONDS = env.float("IOTQUEUE_STUCK_AFTER_SECONDS", default=300.0)
# Finished runs (with their steps and events) older than this are deleted, hourly.
IOTQUEUE_RETENTION_DAYS = env.float("IOTQUEUE_RETENTION_DAYS", default=30.0)
# Events of no run (a device's dropped or unknown messages) are kept this long: they say
# what a device did wrong lately, and a misbehaving device must not fill the table for a month.
IOTQUEUE_ORPHAN_EVENT_RETENTION_DAYS = env.float("IOTQUEUE_ORPHAN_EVENT_RETENTION_DAYS", default=3.0)
# The bridge hands device replies to the workers in groups (jobs/inbox.py): a group is
# sent when this many replies wait, when no new one came for the idle time, or when its
# first one waited the max wait. At low load a reply waits only the idle time (a done not
# at all: it sends its group at once); under load groups grow, and a worker takes up to
# this many groups into one transaction.
IOTQUEUE_REPLY_BATCH_MAX = env.int("IOTQUEUE_REPLY_BATCH_MAX", default=64)
IOTQUEUE_REPLY_BATCH_IDLE_MS = env.float("IOTQUEUE_REPLY_BATCH_IDLE_MS", default=1.0)
IOTQUEUE_REPLY_BATCH_MAX_WAIT_MS = env.float("IOTQUEUE_REPLY_BATCH_MAX_WAIT_MS", default=3.0)
# A worker that emptied the engine's inbox waits this long for the next entry before its
# task returns: at a steady trickle of replies the next one is taken at once instead of
# after a Celery hop. It holds one worker process meanwhile (not for a device: for work).
IOTQUEUE_INBOX_LINGER_MS = env.int("IOTQUEUE_INBOX_LINGER_MS", default=50)
# A trigger repeating an idempotency key within this window gets the existing run back;
# after it, the key starts a new run.
IOTQUEUE_IDEMPOTENCY_HOURS = env.float("IOTQUEUE_IDEMPOTENCY_HOURS", default=24.0)
CELERY_TIMEZONE = TIME_ZONE

# --- MQTT ------------------------------------------------------------------------------
# mqtt://user:pass@host:1883 or mqtts://user:pass@host:8883 (TLS, system CAs or MQTT_CA_FILE)
MQTT_URL = env("MQTT_URL", default="mqtt://127.0.0.1:1883")
MQTT_CA_FILE = env("MQTT_CA_FILE", default="")
# With mqtts://, a client certificate (PEM) and its key, for a broker with require_certificate.
MQTT_CERT_FILE = env("MQTT_CERT_FILE", default="")
MQTT_KEY_FILE = env("MQTT_KEY_FILE", default="")
if bool(MQTT_CERT_FILE) != bool(MQTT_KEY_FILE):
    raise ImproperlyConfigured("MQTT_CERT_FILE and MQTT_KEY_FILE go together: set both or neither")
MQTT_CLIENT_ID_PREFIX = env("MQTT_CLIENT_ID_PREFIX", default="iotqueue")
# The bridge's client id, stable across its restarts so that the broker keeps its session
# (and the replies that arrive while it is away). Unique per replica; empty: the prefix,
# "bridge" and the host name (one bridge per host or container).
MQTT_BRIDGE_CLIENT_ID = env("MQTT_BRIDGE_CLIENT_ID", default="")
# How devices authenticate to the broker. "dynsec": iotqueue manages each device's broker
# user and ACLs (only its own topics) through Mosquitto's dynamic security plugin, with the
# MQTT_URL user as administrator (devices/credentials.py). "none": the broker's identities
# are managed elsewhere (or it is the anonymous pip-only development broker).
IOTQUEUE_MQTT_AUTH = env("IOTQUEUE_MQTT_AUTH", default="dynsec")
if IOTQUEUE_MQTT_AUTH not in ("dynsec", "none"):
    raise ImproperlyConfigured(f"IOTQUEUE_MQTT_AUTH must be 'dynsec' or 'none', not {IOTQUEUE_MQTT_AUTH!r}")
# The device CA (PEM files): POST /api/devices/<name>/certificate/ and the admin sign device
# certificates (CN = device name) with it for the broker's mTLS listener (devices/certificates.py,
# docs/operations.md "Certificate devices"). Unset: nothing is issued (the endpoint answers 503).
IOTQUEUE_DEVICE_CA_CERT = env("IOTQUEUE_DEVICE_CA_CERT", default="")
IOTQUEUE_DEVICE_CA_KEY = env("IOTQUEUE_DEVICE_CA_KEY", default="")
if bool(IOTQUEUE_DEVICE_CA_CERT) != bool(IOTQUEUE_DEVICE_CA_KEY):
    raise ImproperlyConfigured(
        "IOTQUEUE_DEVICE_CA_CERT and IOTQUEUE_DEVICE_CA_KEY go together: set both or neither"
    )
# The CA that signed the broker's own (server) certificate, handed to a certificate device with
# its certificate so it can verify the broker; empty: the device CA (as in the dev stack).
IOTQUEUE_BROKER_CA_CERT = env("IOTQUEUE_BROKER_CA_CERT", default="")
# How long a device certificate is valid: a little over two years, what most TLS stacks accept
# for a leaf (deploy/make-certs.sh uses the same); never past the CA's own end.
IOTQUEUE_DEVICE_CERT_DAYS = env.int("IOTQUEUE_DEVICE_CERT_DAYS", default=825)
# Topic prefix P of the device protocol (docs/protocol.md).
IOTQUEUE_TOPIC_PREFIX = env("IOTQUEUE_TOPIC_PREFIX", default="iotqueue")
# Non-empty: the bridge subscribes as $share/<group>/... so several bridges split the load
# (Mosquitto, EMQX). Leave empty for brokers without shared subscriptions (amqtt).
MQTT_SHARED_GROUP = env("MQTT_SHARED_GROUP", default="")
# Replies larger than this are dropped unread: no device reply needs more, and the bridge
# must not be made to parse megabytes.
IOTQUEUE_MAX_PAYLOAD_BYTES = env.int("IOTQUEUE_MAX_PAYLOAD_BYTES", default=64 * 1024)
# Each device's message budget at the bridge (iotqueue/budget.py): a token bucket of this
# many messages a second, holding up to the burst. Over it, a message is dropped unread and
# counted, so one device's flood cannot crowd out the others' replies. 200/s is ~65 commands
# a second each with ack, progress and done: above the engine's one-device hand-off rate
# (a command at a time, a few ms each) and far above real firmware; the burst lets a device
# that reconnects flush its queued QoS 1 replies and heartbeats at once. Per bridge replica.
IOTQUEUE_DEVICE_MESSAGE_RATE = env.float("IOTQUEUE_DEVICE_MESSAGE_RATE", default=200.0)
IOTQUEUE_DEVICE_MESSAGE_BURST = env.int("IOTQUEUE_DEVICE_MESSAGE_BURST", default=600)

# --- Run events out (webhooks/) -----------------------------------------------------------
# Run lifecycle events on P/events/runs/<run id> (QoS 1) for consumers without HTTP.
IOTQUEUE_RUN_EVENTS_MQTT = env.bool("IOTQUEUE_RUN_EVENTS_MQTT", default=True)
# Lifecycle events wait in a Redis stream until the webhooks.events_out task sends them
# out; the task starts this long after the event that woke it (and after its last look
# that sent something), and takes every event gathered meanwhile at once (one query for
# their runs, one for the webhooks).
IOTQUEUE_EVENTS_OUT_GATHER_MS = env.float("IOTQUEUE_EVENTS_OUT_GATHER_MS", default=50.0)
# Mail the ADMINS (webhooks/mail.py, Django's EMAIL_* settings) when a run fails, times out or is
# rolled back.
IOTQUEUE_FAILED_RUN_EMAIL = env.bool("IOTQUEUE_FAILED_RUN_EMAIL", default=False)
# Comma-separated addresses; "Name:mail@example.com" (the old form) is read as its address.
# Plain addresses: Django 6 drops the (name, address) tuples (webhooks/mail.py reads these).
ADMINS = [admin.rpartition(":")[2].strip() for admin in env.list("ADMINS", default=[])]
SERVER_EMAIL = env("SERVER_EMAIL", default="iotqueue@localhost")
EMAIL_BACKEND = env("EMAIL_BACKEND", default="django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
# One webhook request may take this long: a receiver should answer at once and work later.
IOTQUEUE_WEBHOOK_TIMEOUT_SECONDS = env.float("IOTQUEUE_WEBHOOK_TIMEOUT_SECONDS", default=5.0)
# A wave's webhook gate (webhooks/gates.py) may take this long to answer; past it the
# rollout pauses: a health check answers at once or it is not healthy.
IOTQUEUE_WAVE_GATE_TIMEOUT_SECONDS = env.float("IOTQUEUE_WAVE_GATE_TIMEOUT_SECONDS", default=10.0)
# Attempts per delivery, the wait before the second (doubling after each failure) and its
# cap. The cap stays well below the broker's visibility timeout (CELERY_VISIBILITY_TIMEOUT):
# a retry waiting longer would be handed out a second time.
IOTQUEUE_WEBHOOK_MAX_ATTEMPTS = env.int("IOTQUEUE_WEBHOOK_MAX_ATTEMPTS", default=5)
IOTQUEUE_WEBHOOK_BACKOFF_SECONDS = env.float("IOTQUEUE_WEBHOOK_BACKOFF_SECONDS", default=10.0)
IOTQUEUE_WEBHOOK_BACKOFF_MAX_SECONDS = env.float("IOTQUEUE_WEBHOOK_BACKOFF_MAX_SECONDS", default=120.0)
# Deliveries failing for good in a row (every attempt used) before a webhook is disabled.
IOTQUEUE_WEBHOOK_DISABLE_AFTER = env.int("IOTQUEUE_WEBHOOK_DISABLE_AFTER", default=10)
# Networks (comma-separated CIDRs) webhooks may reach although they are loopback, private or
# link-local; empty: public addresses only (webhooks/addresses.py refuses the rest, SSRF).
IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = env.list("IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS", default=[])

# --- Engine ------------------------------------------------------------------------------
IOTQUEUE_REDIS_KEY_PREFIX = env("IOTQUEUE_REDIS_KEY_PREFIX", default="iq")

# --- Metrics and logs -------------------------------------------------------------------
# Set: Prometheus scrapes /metrics with "Authorization: Bearer <token>". Either way, signed-in
# staff users may open /metrics; nobody else may.
IOTQUEUE_METRICS_TOKEN = env("IOTQUEUE_METRICS_TOKEN", default="")
# "text" for people, "json" (one object per line) for log shippers. Timeline events carry
# event, run_id, step, attempt, device and command_id as separate fields (jobs/events.py).
IOTQUEUE_LOG_FORMAT = env("IOTQUEUE_LOG_FORMAT", default="text")
if IOTQUEUE_LOG_FORMAT not in ("text", "json"):
    raise ImproperlyConfigured(f"IOTQUEUE_LOG_FORMAT must be 'text' or 'json', not {IOTQUEUE_LOG_FORMAT!r}")
# Celery worker and beat replace the root logger's handlers with their own text format
# unless told not to: in JSON mode they must keep the handler configured below.
CELERY_WORKER_HIJACK_ROOT_LOGGER = IOTQUEUE_LOG_FORMAT == "text"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        # Control characters in a message escaped, so that text a device sent cannot start a
        # line of its own (iotqueue/logfmt.py).
        "text": {
            "class": "iotqueue.logfmt.TextFormatter",
            "format": "%(asctime)s %(levelname)s %(name)s %(message)s",
        },
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(levelname)s %(name)s %(message)s",
            "timestamp": True,  # ISO 8601, UTC
        },
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": IOTQUEUE_LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="INFO")},
    "loggers": {
        "amqtt": {"level": "WARNING"},
        "transitions": {"level": "WARNING"},
        # Two INFO lines per task (received, succeeded) cost more than a step's own work;
        # failures are still logged (ERROR), and the engine logs every transition itself.
        "celery.app.trace": {"level": env("CELERY_TASK_LOG_LEVEL", default="WARNING")},
        "celery.worker.strategy": {"level": env("CELERY_TASK_LOG_LEVEL", default="WARNING")},
    },
}
