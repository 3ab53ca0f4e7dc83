"""Which broker clients and roles iotqueue may change: its marked ones and adopted legacy ones."""

import pytest

from devices.credentials import Identity, role_name
from iotqueue.dynsec import ADMIN_ROLE, MANAGED_MARK

NAME = "lamp-2"
ROLE = role_name(NAME)
MARKED_ROLE = {"rolename": ROLE, "textdescription": MANAGED_MARK}
OLD_ROLE = {"rolename": ROLE}


def client(*, mark: bool = False, textname: str = f"device {NAME}", roles=(ROLE,), groups=()) -> dict:
    entry = {"username": NAME, "textname": textname, "roles": [{"rolename": r} for r in roles]}
    entry["groups"] = [{"groupname": g} for g in groups]
    return {**entry, "textdescription": MANAGED_MARK} if mark else entry


@pytest.mark.parametrize(
    ("given_client", "given_role"),
    [
        (None, None),  # a new name
        (client(mark=True), MARKED_ROLE),
        (client(mark=True, roles=()), None),  # role lost: written again
        (client(), OLD_ROLE),  # made before the mark: adopted
        (client(), MARKED_ROLE),  # half adopted
        (None, MARKED_ROLE),  # a role left over from a half-done removal
    ],
)
def test_iotqueue_may_write_its_own_identities(given_client, given_role):
    assert Identity(NAME, given_client, given_role).foreign_reason() is None


@pytest.mark.parametrize(
    ("given_client", "given_role", "what"),
    [
        (client(textname="edge consumer", roles=()), None, "user"),
        (client(textname="ops", roles=(ADMIN_ROLE,)), None, "user"),
        # the pre-mark code gave a foreign user the device role next to its own: still foreign
        (client(textname="ops", roles=(ADMIN_ROLE, ROLE)), OLD_ROLE, "user"),
        (client(textname="ops"), OLD_ROLE, "user"),  # exactly the role, but not iotqueue's text name
        (client(groups=("ops",)), OLD_ROLE, "user"),
        (None, OLD_ROLE, "role"),  # a role of this name nobody marked
        (client(mark=True), OLD_ROLE, "role"),
    ],
)
def test_a_name_held_by_someone_else_is_foreign(given_client, given_role, what):
    reason = Identity(NAME, given_client, given_role).foreign_reason()
    assert reason and f"a {what} named" in reason


def test_only_an_adopted_legacy_client_takes_its_unmarked_role_with_it():
    legacy = Identity(NAME, client(), OLD_ROLE)
    foreign = Identity(NAME, client(textname="ops", roles=(ADMIN_ROLE, ROLE)), OLD_ROLE)
    assert legacy.legacy and legacy.client_ours and legacy.role_ours
    assert not foreign.client_ours and not foreign.role_ours
