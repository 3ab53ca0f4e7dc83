"""The API docs work on a network without internet: Swagger UI and Redoc come from the
project's own static files (drf-spectacular-sidecar), never from a CDN. Before, both pages
loaded their scripts from a CDN and were blank offline (`SwaggerUIBundle is not defined`)."""

from __future__ import annotations

import re

import pytest
from django.contrib.staticfiles import finders

pytestmark = pytest.mark.django_db

ASSET = re.compile(r"""(?:src|href)=["']([^"']+\.(?:js|css|png))["']""")
# Any address on another host (a CDN's, say), in an attribute or a script: `//host/...`.
# (Not the bare word "cdn": the page's random CSRF token spells it now and then.)
OFFSITE = re.compile(r"""(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}/""", re.IGNORECASE)


@pytest.mark.parametrize("page", ["/api/docs/", "/api/docs/redoc/"])
def test_the_api_docs_load_only_local_static_files(admin_api, page):
    # when a docs page is opened
    response = admin_api.get(page)
    assert response.status_code == 200
    html = response.content.decode()

    # then every script, style sheet and icon it loads is one of ours, and exists
    assets = ASSET.findall(html)
    assert assets, html[:500]
    for asset in assets:
        assert asset.startswith("/static/"), f"{page} loads {asset} from elsewhere"
        assert finders.find(asset.removeprefix("/static/")), f"{asset} is not among the static files"
    assert not OFFSITE.findall(html), f"{page} names another host: {OFFSITE.findall(html)}"
