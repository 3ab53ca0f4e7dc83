"""Import-time checks for the code that touches a library's private API.

A few modules rely on what a library does not promise: `kombu_fix` wraps kombu's
`Channel._connparams`, `beat_lease.LeasedDatabaseScheduler` writes django-celery-beat's
(and Celery's) scheduler state, `openapi` overrides drf-spectacular's `_get_response_bodies`.
Each declares the version it was written for (`WRITTEN_FOR`) and calls `private_api_check`
at import:

- a private name it touches is gone: raise PrivateAPIError, always (the code would break);
- another installed version: raise PrivateAPIError in development and tests (DEBUG), log an
  error otherwise (the lock file pins the version; a production install that differs still
  starts, loudly).

The message names the package, both versions and what to re-read, so an upgrade is: bump the
pin, run the tests, re-read what the failing check names, then update `WRITTEN_FOR`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from importlib import metadata

from django.conf import settings

log = logging.getLogger(__name__)

TRUE_WORDS = {"1", "true", "yes", "on"}


class PrivateAPIError(RuntimeError):
    """A library this project patches or subclasses privately is not the version it was written for."""


def _strict() -> bool:
    """DEBUG (development, the test suite): a version mismatch raises. Read from the settings
    once they are loaded, else from the environment they read it from (the Celery app, and so
    `kombu_fix`, is imported before the settings)."""
    if settings.configured:
        return bool(settings.DEBUG)
    return os.environ.get("DEBUG", "").strip().lower() in TRUE_WORDS


def names_defined(owner: type) -> set[str]:
    """Attribute names a class and its bases define, or read and assign in their methods
    (`self._dirty = set()` in `__init__` defines `_dirty` on every instance)."""
    names: set[str] = set()
    for klass in owner.__mro__:
        names.update(vars(klass))
        for value in vars(klass).values():
            function = getattr(value, "fget", value)
            code = getattr(function, "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return names


def private_api_check(
    written_for: tuple[str, str],
    *,
    owner: type,
    attributes: Iterable[str],
    where: str,
) -> None:
    """Check that `written_for` = (distribution, version) is installed and `owner` still has
    every private attribute in `attributes`.

    How it fails: PrivateAPIError naming the package, the installed and the written-for
    version, and `where` (the code to re-read); a version mismatch alone only logs an error
    when DEBUG is off.
    """
    package, version = written_for
    installed = metadata.version(package)
    present = names_defined(owner)
    missing = sorted(name for name in attributes if name not in present)
    owner_name = f"{owner.__module__}.{owner.__qualname__}"
    if missing:
        raise PrivateAPIError(
            f"{package} {installed} is installed, {where} was written for {version}, and "
            f"{owner_name} no longer has {', '.join(missing)}: re-read {where} against "
            f"{package} {installed}, then update its WRITTEN_FOR"
        )
    if installed == version:
        return
    message = (
        f"{package} {installed} is installed, {where} was written for {version}: it uses "
        f"{owner_name}'s private {', '.join(sorted(attributes))}; re-read {where} against "
        f"{package} {installed}, then update its WRITTEN_FOR"
    )
    if _strict():
        raise PrivateAPIError(message)
    log.error("%s", message)
