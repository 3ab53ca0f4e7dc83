"""Settings for iotqueue, read from the environment (12-factor).

Every value has a development default so `make run` works on a bare machine; production
sets DATABASE_URL, REDIS_URL, MQTT_URL, SECRET_KEY and DEBUG=false.
"""

import os
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
# Runtime files of the dev stack (SQLite database, server logs); never committed.
VAR_DIR = BASE_DIR / "var"
VAR_DIR.mkdir(exist_ok=True)

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=True)
SECRET_KEY = env("SECRET_KEY", default="dev-only-insecure-key-change-me")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "testserver"])

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
    "django_celery_beat",
    "iotqueue",
    "devices",
    "jobs",
    "triggers",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's CSS and JavaScript, the live run view) from gunicorn itself,
    # after `collectstatic` (the image runs it); runserver serves them in development.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "iotqueue.api.NulRefusingMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "iotqueue.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
    # Bridge, workers and web write concurrently: WAL and a busy timeout keep SQLite
    # from failing with "database is locked" under the dev stack's modest load.
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

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = env("TIME_ZONE", default="UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # empty until collectstatic; WhiteNoise warns if it is missing

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
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "iotqueue API",
    "DESCRIPTION": "Devices, job templates and runs: start, follow and cancel jobs on IoT devices over MQTT.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "jobs.models.RunStatus",
        "StepStatusEnum": "jobs.models.StepStatus",
    },
}

# --- Redis: Celery broker and device locks -------------------------------------------
REDIS_URL = env("REDIS_URL", default="redis://127.0.0.1:6379/0")

CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# Tests give each session its own queue so a shared Redis never mixes their tasks.
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default="celery")
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
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
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# The monitor tick (timeouts, retries, lease reclaim); its period bounds how late a
# deadline fires. DatabaseScheduler copies this entry into its table on start, and
# `manage.py monitors_install` does so too (both idempotent).
IOTQUEUE_MONITOR_INTERVAL = env.float("IOTQUEUE_MONITOR_INTERVAL", default=1.0)
# How often the monitor sweeps the database for work Redis lost (a killed worker's task,
# a Redis restart); a lost step is rescued within about this long.
IOTQUEUE_RECONCILE_SECONDS = env.float("IOTQUEUE_RECONCILE_SECONDS", default=30.0)
# Lease of a holder that was handed a device's lock, until its dispatch extends it: how
# long a hand-off lost with a killed worker keeps the device idle.
IOTQUEUE_HANDOFF_LEASE_SECONDS = env.float("IOTQUEUE_HANDOFF_LEASE_SECONDS", default=60.0)
# Finished runs (with their steps and events) older than this are deleted, hourly.
IOTQUEUE_RETENTION_DAYS = env.float("IOTQUEUE_RETENTION_DAYS", default=30.0)
# The bridge hands device replies to the workers in groups (jobs/inbox.py): a group is
# sent when this many replies wait, when no new one came for the idle time, or when its
# first one waited the max wait. At low load a reply waits only the idle time; under
# load groups grow, and a worker takes up to this many groups into one transaction.
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
CELERY_BEAT_SCHEDULE = {
    "iotqueue-monitor": {"task": "jobs.monitor_tick", "schedule": IOTQUEUE_MONITOR_INTERVAL},
    "iotqueue-retention": {"task": "jobs.runs_prune", "schedule": 3600.0},
}
CELERY_TIMEZONE = TIME_ZONE

# --- MQTT ------------------------------------------------------------------------------
# mqtt://user:pass@host:1883 or mqtts://user:pass@host:8883 (TLS, system CAs or MQTT_CA_FILE)
MQTT_URL = env("MQTT_URL", default="mqtt://127.0.0.1:1883")
MQTT_CA_FILE = env("MQTT_CA_FILE", default="")
MQTT_CLIENT_ID_PREFIX = env("MQTT_CLIENT_ID_PREFIX", default="iotqueue")
# Topic prefix P of the device protocol (docs/protocol.md).
IOTQUEUE_TOPIC_PREFIX = env("IOTQUEUE_TOPIC_PREFIX", default="iotqueue")
# Non-empty: the bridge subscribes as $share/<group>/... so several bridges split the load
# (Mosquitto, EMQX). Leave empty for brokers without shared subscriptions (amqtt).
MQTT_SHARED_GROUP = env("MQTT_SHARED_GROUP", default="")
# Replies larger than this are dropped unread: no device reply needs more, and the bridge
# must not be made to parse megabytes.
IOTQUEUE_MAX_PAYLOAD_BYTES = env.int("IOTQUEUE_MAX_PAYLOAD_BYTES", default=64 * 1024)

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
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
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
