"""Who may start runs: the one permission every entry point that starts runs, or sets up
something that will (schedules, trigger rules), checks."""

from __future__ import annotations

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser

# What POST /api/runs/ requires (Django's add permission on runs, through the API's model
# permissions); retry and the admin's "Run now" ask for the same.
RUN_START_PERMISSION = "jobs.add_jobrun"


def user_may_start_runs(user: AbstractBaseUser | AnonymousUser) -> bool:
    return user.has_perm(RUN_START_PERMISSION)
