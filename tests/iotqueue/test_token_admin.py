"""The API token admin never shows a token's key: a prefix only, to users who may change
tokens; no page, link, checkbox or filter gives away the rest (iotqueue/admin.py)."""

from __future__ import annotations

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.test import Client
from rest_framework.authtoken.models import Token

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/authtoken/tokenproxy/"


def staff_client(username: str, *codenames: str) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="authtoken", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def admin_token() -> Token:
    admin = User.objects.create_superuser("admin", "a@example.com", "pw")
    return Token.objects.create(user=admin)


def test_a_view_only_staff_user_sees_who_has_a_token_and_no_key(admin_token):
    # given a staff user who may only view tokens
    viewer = staff_client("viewer", "view_tokenproxy")

    # when it opens the token list, and every page of the admin's token it can name
    listing = viewer.get(CHANGELIST)
    pages = [
        viewer.get(f"{CHANGELIST}{admin_token.user_id}/{page}", follow=True)
        for page in ("change/", "history/", "delete/")
    ]

    # then the list names the admin, and nothing shows any part of the key
    assert listing.status_code == 200 and "admin" in listing.text
    for page in [listing, *pages]:
        assert admin_token.key not in page.text
        assert admin_token.key[:6] not in page.text
    # and no row links to a page of its own
    assert f"{CHANGELIST}{admin_token.user_id}/change/" not in listing.text


def test_the_key_cannot_be_found_through_the_lists_filters(admin_token):
    viewer = staff_client("viewer", "view_tokenproxy")

    # a prefix filter would tell a viewer, character by character, whether a key starts so
    probe = viewer.get(CHANGELIST, {"key__startswith": admin_token.key[0]})
    by_pk = viewer.get(CHANGELIST, {"pk__startswith": admin_token.key[0]})
    search = viewer.get(CHANGELIST, {"q": admin_token.key[:4]})

    assert probe.status_code == 400 and by_pk.status_code == 400
    # and a search matches usernames, not keys
    assert search.status_code == 200 and search.context["cl"].result_count == 0


def test_a_user_who_may_change_tokens_sees_a_prefix_only(admin_token):
    manager = staff_client("manager", "view_tokenproxy", "change_tokenproxy")

    listing = manager.get(CHANGELIST)

    assert listing.status_code == 200
    assert f"{admin_token.key[:6]}…" in listing.text
    assert admin_token.key not in listing.text
    assert admin_token.key[:7] not in listing.text


def test_a_user_who_may_delete_tokens_revokes_them_by_user(admin_token):
    # given another user's token too, and a staff user who may delete tokens
    other = Token.objects.create(user=User.objects.create_user("service", password="pw"))
    revoker = staff_client("revoker", "view_tokenproxy", "delete_tokenproxy")
    listing = revoker.get(CHANGELIST)
    assert admin_token.key not in listing.text

    # when it revokes the admin's token from the list
    answer = revoker.post(
        CHANGELIST, {"action": "tokens_revoke", ACTION_CHECKBOX_NAME: [str(admin_token.user_id)]}, follow=True
    )

    # then that token is gone and the other stays
    assert answer.status_code == 200
    assert not Token.objects.filter(pk=admin_token.pk).exists()
    assert Token.objects.filter(pk=other.pk).exists()


def test_nobody_adds_a_token_in_the_admin_which_would_show_its_key():
    client = Client()
    client.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))

    assert client.get(f"{CHANGELIST}add/").status_code == 403


def test_the_bulk_delete_whose_confirmation_lists_keys_is_not_offered(admin_token):
    # given a staff user who may delete tokens
    deleter = staff_client("deleter", "view_tokenproxy", "delete_tokenproxy")

    # when it asks for Django's bulk delete, whose confirmation page lists each token's text
    answer = deleter.post(
        CHANGELIST,
        {"action": "delete_selected", "select_across": "1", ACTION_CHECKBOX_NAME: [str(admin_token.user_id)]},
        follow=True,
    )

    # then there is no such action, and no key on any page
    assert 'value="delete_selected"' not in deleter.get(CHANGELIST).text
    assert admin_token.key not in answer.text
    assert Token.objects.filter(pk=admin_token.pk).exists()
