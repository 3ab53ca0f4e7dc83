# One image for every iotqueue process: web (gunicorn), Celery worker and beat, the MQTT
# bridge and migrations. docker-compose.yml picks the command per service. The simulated
# devices (compose profile `sim`) run from the `sim` target: this image plus devtools/.
FROM python:3.11-slim AS runtime

# No .pyc files (the code is read-only for the app user), logs straight to `docker logs`.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=iotqueue.settings

WORKDIR /app

# Dependencies first, so a code change does not reinstall them: the runtime tree locked from
# requirements.txt (`make lock`), every package pinned and checked against its hashes.
COPY requirements/lock.txt ./requirements/lock.txt
RUN pip install --require-hashes -r requirements/lock.txt

RUN groupadd --system iotqueue \
    && useradd --system --gid iotqueue --home-dir /app --no-create-home --shell /usr/sbin/nologin iotqueue

# Only the product's code: no virtualenv, var/, .git or devtools/ from the build context.
COPY manage.py ./
COPY iotqueue ./iotqueue
COPY devices ./devices
COPY jobs ./jobs
COPY triggers ./triggers
COPY webhooks ./webhooks
COPY locale ./locale

# The translation catalogues (locale/*.po -> .mo, pure Python): the .mo files are not committed.
RUN python -m iotqueue.catalogue compile

# The admin's static files, served by WhiteNoise from var/static (STATIC_ROOT). Copying files
# needs no secret: this one command runs in development mode, the image itself does not.
RUN DEBUG=true python manage.py collectstatic --noinput --verbosity 0

# var/ holds the SQLite file when no DATABASE_URL is set; it must be writable then.
RUN mkdir -p /app/var && chown iotqueue:iotqueue /app/var

USER iotqueue

EXPOSE 8000
# The web's liveness (/healthz, no dependency; iotqueue/probes.py). The image has no curl, so
# Python's urllib asks. The worker, beat and bridge run this image too: their services replace
# it with `python manage.py healthcheck worker|beat|bridge` (docker-compose.yml).
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["gunicorn", "iotqueue.wsgi:application", "--bind", "0.0.0.0:8000"]

# Development tooling on top of the runtime image, for the simulator service only: the
# simulate and demo commands need nothing beyond the runtime requirements and the device agent
# library's package (iotqueue-device/, importable from /app; its one dependency, paho-mqtt, is
# in the runtime tree). Never deployed.
FROM runtime AS sim
COPY devtools ./devtools
COPY iotqueue-device/iotqueue_device ./iotqueue_device

# The default target is the last stage: a plain `docker build .` gives the runtime image.
FROM runtime
