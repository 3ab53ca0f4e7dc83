"""Settings of the test suite: the project's own, in development mode (DEBUG on).

Settings fail closed, and the suite runs with the development SECRET_KEY and hosts. DEBUG is
set in the environment, not only here, so the worker, beat and bridge the suite starts (with
iotqueue.settings and this process's environment) run in development mode too.
"""

import os

os.environ["DEBUG"] = "true"

from iotqueue.settings import *  # noqa: F403
