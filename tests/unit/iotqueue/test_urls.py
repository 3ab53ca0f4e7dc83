"""The site's root leads to the operator console."""

from __future__ import annotations

import pytest


@pytest.mark.django_db
def test_the_root_redirects_to_the_admin_temporarily(client):
    # when a browser opens the site's root
    response = client.get("/")

    # then it is sent on to the admin (not a debug 404), and may be sent elsewhere one day
    assert response.status_code == 302
    assert response["Location"] == "/admin/"
