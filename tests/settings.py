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

from iotqueue.catalogue import catalogue_compile
from iotqueue.settings import *  # noqa: F403

# The Chinese pages need the compiled catalogue: `make install` builds it, and a .po changed
# since (a pull, an edit) is compiled again here, so a plain `pytest` sees the current one.
catalogue_compile(stale_only=True)
