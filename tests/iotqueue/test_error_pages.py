"""A URL under /api/ that no route matches answers in JSON, as the schema documents."""

import pytest

pytestmark = pytest.mark.django_db


def test_an_unrouted_api_url_is_a_json_404(admin_api):
    # a device name outside the name alphabet matches no route at all
    response = admin_api.get("/api/devices/no%20such%20name/")
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": "Not found."}


def test_other_urls_keep_djangos_own_404(client):
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
