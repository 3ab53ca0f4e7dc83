"""What a device certificate must be, without `cryptography`: the longest common name, the
largest CSR read, and the errors issuing one raises (devices/certificates.py signs).

The admin, the REST API and their serializers check and report with these alone, so a
process that never signs (the bridge, the workers) does not load `cryptography` (about
17 MB of memory per process; devices/credentials.py imports devices/certificates.py only
when it issues a certificate).
"""

from __future__ import annotations

from django.utils.translation import gettext as _

# The longest common name a certificate holds (X.520 ub-common-name): a longer device name
# (names may have 128 characters) cannot be a certificate's CN, so such a device gets none.
COMMON_NAME_MAX_LENGTH = 64
# The largest CSR read (PEM text): a 4096-bit RSA request is ~1.7 KB; anything far bigger is not one.
CSR_MAX_CHARS = 16 * 1024


class AuthorityUnavailable(RuntimeError):
    """No device CA is configured, or its files cannot be read: nothing can be signed."""


class NameUnfit(ValueError):
    """The device's name cannot be a certificate's CN (longer than COMMON_NAME_MAX_LENGTH)."""


def common_name_check(name: str) -> None:
    """Raise NameUnfit (translated message) when `name` cannot be a certificate's CN."""
    if len(name) > COMMON_NAME_MAX_LENGTH:
        raise NameUnfit(
            _(
                "a certificate's common name holds at most %(max)d characters and this device's name "
                "has %(length)d: rename the device to give it a certificate"
            )
            % {"max": COMMON_NAME_MAX_LENGTH, "length": len(name)}
        )


class CsrRefused(ValueError):
    """A certificate signing request iotqueue will not sign (the message says why, translated)."""
