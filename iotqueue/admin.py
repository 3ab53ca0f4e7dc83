"""The API token admin: who has a token and since when, never the token itself.

DRF's own token admin lists every key in full, so a staff user who may only view tokens
could copy the admin's and act as the admin through the API. A token's key is also its
primary key, and Django's admin writes an object's primary key and text into its change,
history and delete pages and into the action checkboxes: here the list shows a token's
first characters (to tell tokens apart) only to users who may change tokens, rows link
nowhere, the object pages are closed, and the only action (revoke) selects rows by their
user. Tokens stay stored as DRF keeps them (TokenAuthentication looks a key up as it is
sent); keeping them out of every page is what keeps them secret here, with the database
file readable by its owner only (iotqueue/backends/sqlite3/base.py).
"""

from __future__ import annotations

import logging

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import gettext_noop, ngettext
from rest_framework.authtoken.admin import TokenAdmin as DrfTokenAdmin
from rest_framework.authtoken.models import TokenProxy

log = logging.getLogger(__name__)

# Characters of a key shown to tell tokens apart: 6 hex digits are 24 of a key's 160 bits,
# too few to guess the rest from, enough to match a token a user quotes.
KEY_PREFIX_LENGTH = 6
# django-axes (the login lockout) ships no Chinese catalogue: the names its admin pages show
# are marked here so that makemessages puts them in the project's, which Django consults first.
AXES_ADMIN_NAMES = (
    gettext_noop("access attempt"),
    gettext_noop("access attempts"),
    gettext_noop("access failure"),
    gettext_noop("access failures"),
    gettext_noop("access log"),
    gettext_noop("access logs"),
)


def key_prefix(key: str) -> str:
    """The first characters of a token's key and an ellipsis: never the whole key."""
    return f"{key[:KEY_PREFIX_LENGTH]}…"


admin.site.unregister(TokenProxy)


@admin.register(TokenProxy)
class TokenAdmin(DrfTokenAdmin):
    """Tokens by user; a key's prefix only for users who may change tokens; revoke in bulk."""

    list_display_links = None
    actions = ["tokens_revoke"]

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        # Its confirmation page lists each token as its text, which is the key (and logs it).
        actions.pop("delete_selected", None)
        return actions

    def get_list_display(self, request: HttpRequest) -> tuple[str, ...]:
        if super().has_change_permission(request):
            return ("user", "key_shown", "created")
        return ("user", "created")

    @admin.display(description=_("Key (first characters)"))
    def key_shown(self, token: TokenProxy) -> str:
        return key_prefix(token.key)

    def action_checkbox(self, token: TokenProxy) -> str:
        # Django's checkbox carries the primary key and the object's text, both the token's
        # key here: it carries its user's id and name instead.
        label = format_html(_("Select the API token of {}"), token.user)
        checkbox = forms.CheckboxInput({"class": "action-select", "aria-label": label}, lambda value: False)
        return checkbox.render(helpers.ACTION_CHECKBOX_NAME, str(token.user_id))

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # `?key__startswith=a` would let a viewer find a key character by character.
        if lookup.split("__")[0] in ("key", "pk"):
            return False
        return super().lookup_allowed(lookup, value, request)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> None:
        # The change, history and delete pages show the object's text: its key.
        return None

    def has_view_permission(self, request: HttpRequest, obj: TokenProxy | None = None) -> bool:
        return obj is None and super().has_view_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: TokenProxy | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TokenProxy | None = None) -> bool:
        return obj is None and super().has_delete_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        # The add page would answer with the new key; a user gets one from POST /api/token/.
        return False

    @admin.action(description=_("Revoke the selected API tokens"), permissions=["delete"])
    def tokens_revoke(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Delete the tokens of the selected users (every token listed, with "select all")."""
        if request.POST.get("select_across") != "1":
            users = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
            queryset = self.get_queryset(request).filter(user_id__in=users)
        revoked = [str(token.user) for token in queryset.select_related("user")]
        queryset.delete()
        log.info("API tokens of %s revoked by %s", ", ".join(revoked) or "nobody", request.user)
        message = ngettext(
            "Revoked the API token of %(count)d user.",
            "Revoked the API tokens of %(count)d users.",
            len(revoked),
        )
        self.message_user(request, message % {"count": len(revoked)}, messages.SUCCESS)
