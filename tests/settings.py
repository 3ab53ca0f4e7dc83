"""Settings of the test suite: the project's own, in development mode (DEBUG on).

Settings fail closed, and the suite runs with the development SECRET_KEY and hosts. DEBUG is
set in the environment, not only here, so the worker, beat and bridge the suite starts (with
iotqueue.settings and this process's environment) run in development mode too.
"""

import os

os.environ["DEBUG"] = "true"
# The webhook tests' receivers listen on 127.0.0.1, which webhooks refuse unless listed
# (tests/webhooks prove that, without the list, loopback is refused).
os.environ.setdefault("IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS", "127.0.0.0/8")

from django.conf import global_settings

from iotqueue.catalogue import catalogue_compile
from iotqueue.settings import *  # noqa: F403

# The Chinese pages need the compiled catalogue: `make install` builds it, and a .po changed
# since (a pull, an edit) is compiled again here, so a plain `pytest` sees the current one.
catalogue_compile(stale_only=True)

# A password hash costs production's PBKDF2 a million rounds (a second and more on a shared
# CI machine), and nearly every stack test signs in a user it just made. The suite hashes with
# MD5 instead; PBKDF2 stays listed so that a hash made by a child process (iotqueue.settings)
# still verifies here. What a test proves about sign-in does not depend on the hash's cost.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", *global_settings.PASSWORD_HASHERS]
