"""
WSGI config for iotqueue project.

It exposes the WSGI callable as a module-level variable named ``application``.

For more information on this file, see
https://docs.djangoproject.com/en/5.2/howto/deployment/wsgi/
"""

import os

from django.core.wsgi import get_wsgi_application

from iotqueue.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "iotqueue.settings")

# A worker that cannot load the application exits with this status: gunicorn's arbiter then
# stops ("Worker failed to boot", its WORKER_BOOT_ERROR) instead of forking the next worker
# into the same error. Other WSGI servers see a non-zero exit.
WORKER_BOOT_ERROR = 3

# Settings that fail closed (no SECRET_KEY or ALLOWED_HOSTS without DEBUG) end the web
# process in one line naming what to set, not in a traceback (iotqueue/startup.py).
settings_load_or_exit("web", status=WORKER_BOOT_ERROR)
application = get_wsgi_application()
