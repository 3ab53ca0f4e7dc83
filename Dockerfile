# One image for every iotqueue process: web (gunicorn), Celery worker and beat, the MQTT
# bridge, migrations and the simulator. docker-compose.yml picks the command per service.
FROM python:3.11-slim

# No .pyc files (the code is read-only for the app user), logs straight to `docker logs`.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=iotqueue.settings

WORKDIR /app

# Dependencies first, so a code change does not reinstall them.
COPY requirements.txt ./
RUN pip install -r requirements.txt

RUN groupadd --system iotqueue \
    && useradd --system --gid iotqueue --home-dir /app --no-create-home --shell /usr/sbin/nologin iotqueue

# Only the project's code: no virtualenv, var/ or .git from the build context.
COPY manage.py ./
COPY iotqueue ./iotqueue
COPY devices ./devices
COPY jobs ./jobs
COPY triggers ./triggers

# The admin's static files, served by WhiteNoise from var/static (STATIC_ROOT).
RUN python manage.py collectstatic --noinput --verbosity 0

# settings.py creates var/ at import (SQLite file, dev-stack logs); it must be writable.
RUN mkdir -p /app/var && chown iotqueue:iotqueue /app/var

USER iotqueue

EXPOSE 8000
CMD ["gunicorn", "iotqueue.wsgi:application", "--bind", "0.0.0.0:8000"]
