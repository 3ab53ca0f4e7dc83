"""Shared concurrency limits as an operator defines and reads them: REST CRUD with refusals
keyed by field, the admin's list and a limit's page with its slots in use now, the preview
listing the limits that apply, and which commands a limit applies to."""

import uuid

import pytest
from django.contrib.auth.models import User

from devices.lock_slots import Slot
from devices.locks import LockBatch, device_locks_apply, lock_epoch_start
from jobs.limits import Limit, limits_applying, limits_forget
from jobs.models import ConcurrencyLimit
from jobs.preview import run_preview
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(90)]


@pytest.fixture(autouse=True)
def _limits_forgotten():
    """The test's limits are rolled back with its database: none stays cached for the next."""
    yield
    limits_forget()


DOWNLOADS = {"name": "store-downloads", "label": "site", "max_concurrent": 3, "match": "firmware/download"}


def test_a_limit_is_created_read_changed_and_removed_by_name(admin_api):
    created = admin_api.post("/api/limits/", DOWNLOADS, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["applies_to"] == "action" and created.json()["enabled"] is True
    assert [item["name"] for item in admin_api.get("/api/limits/").json()["results"]] == ["store-downloads"]
    changed = admin_api.patch("/api/limits/store-downloads/", {"max_concurrent": 2}, format="json")
    assert changed.status_code == 200 and changed.json()["max_concurrent"] == 2
    assert admin_api.delete("/api/limits/store-downloads/").status_code == 204
    assert not ConcurrencyLimit.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**DOWNLOADS, "match": ""}, "match"),
        ({**DOWNLOADS, "applies_to": "all"}, "match"),
        ({**DOWNLOADS, "applies_to": "template", "match": "no-such-template"}, "match"),
        ({**DOWNLOADS, "max_concurrent": 0}, "max_concurrent"),
        ({**DOWNLOADS, "name": "store downloads/1"}, "name"),
        ({**DOWNLOADS, "label": " "}, "label"),
        ({**DOWNLOADS, "applies_to": "sometimes"}, "applies_to"),
    ],
)
def test_a_refused_limit_says_which_field(admin_api, body, field):
    answer = admin_api.post("/api/limits/", body, format="json")
    assert answer.status_code == 400
    assert field in answer.json(), answer.json()


def test_a_reader_may_list_limits_but_not_add_one(reader_api):
    ConcurrencyLimit.objects.create(**DOWNLOADS)
    assert reader_api.get("/api/limits/").status_code == 200
    assert reader_api.post("/api/limits/", {**DOWNLOADS, "name": "other"}, format="json").status_code == 403


def test_which_commands_a_limit_applies_to():
    template = JobTemplateFactory()
    limits = {
        "action": Limit("a", "site", 3, "action", "firmware/download", None),
        "prefix": Limit("p", "site", 3, "prefix", "firmware/", None),
        "template": Limit("t", "site", 3, "template", template.name, template.pk),
        "all": Limit("x", "site", 3, "all", "", None),
    }
    assert limits["action"].applies(action="firmware/download", template_id=None)
    assert not limits["action"].applies(action="firmware/downloads", template_id=None)
    assert limits["prefix"].applies(action="firmware/flash", template_id=None)
    assert not limits["prefix"].applies(action="reboot", template_id=None)
    assert limits["template"].applies(action="reboot", template_id=template.pk)
    assert not limits["template"].applies(action="reboot", template_id=template.pk + 1)
    assert limits["all"].applies(action="reboot", template_id=None)
    assert limits["action"].describe() == "limit 'a' (3 per site)"
    # Saved limits are read again at once in this process; a device without the label is free.
    ConcurrencyLimit.objects.create(**DOWNLOADS)
    applying = limits_applying(action="firmware/download", template_id=None, labels={"site": "store-17"})
    assert [(limit.name, value) for limit, value in applying] == [("store-downloads", "store-17")]
    assert limits_applying(action="firmware/download", template_id=None, labels={}) == []
    ConcurrencyLimit.objects.filter(name="store-downloads").update(enabled=False)
    ConcurrencyLimit.objects.get(name="store-downloads").save()
    assert limits_applying(action="firmware/download", template_id=None, labels={"site": "s"}) == []


def test_the_admin_lists_limits_and_a_limits_page_shows_its_slots_in_use(client, settings):
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"limtest-{uuid.uuid4().hex[:8]}"
    lock_epoch_start()
    client.force_login(User.objects.create_superuser("boss", "boss@example.com", "pw"))
    limit = ConcurrencyLimit.objects.create(**{**DOWNLOADS, "max_concurrent": 1})
    batch = LockBatch()
    for i in range(2):
        batch.acquire(
            f"gw-17-{i}",
            holder=f"task:{i}",
            priority=5,
            lease_seconds=30,
            slots=[Slot(limit.name, "store-17", 1)],
        )
    device_locks_apply(batch)
    listing = client.get("/admin/jobs/concurrencylimit/").text
    assert "store-downloads" in listing and "firmware/download" in listing
    page = client.get(f"/admin/jobs/concurrencylimit/{limit.pk}/change/").text
    assert "site=store-17: 1 of 1 in flight, 1 waiting" in page


def test_the_preview_lists_the_limits_that_apply_to_a_step(settings, client):
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"limtest-{uuid.uuid4().hex[:8]}"
    tag = uuid.uuid4().hex[:6]
    for i in range(5):
        DeviceFactory(name=f"gw-{tag}-{i}", labels={"kind": tag, "site": "store-17" if i < 3 else "store-18"})
    DeviceFactory(name=f"gw-{tag}-unlabelled", labels={"kind": tag})
    ConcurrencyLimit.objects.create(**DOWNLOADS)
    ConcurrencyLimit.objects.create(name="reboots", label="site", max_concurrent=1, match="reboot")
    step = JobStepFactory(device=None, labels={"kind": tag}, action="firmware/download")

    preview = run_preview(template=step.template)

    assert preview["steps"][0]["limits"] == [
        {
            "name": "store-downloads",
            "description": "limit 'store-downloads' (3 per site)",
            "label": "site",
            "max_concurrent": 3,
            "devices": 5,
            "label_values": 2,
            "largest": {"value": "store-17", "devices": 3},
        }
    ]
    # The admin's Preview says so too.
    client.force_login(User.objects.create_superuser("previewer", "p@example.com", "pw"))
    page = client.post(f"/admin/jobs/jobtemplate/{step.template.pk}/run/", {"_preview": "Preview"})
    assert page.status_code == 200, page.text
    assert "limit &#x27;store-downloads&#x27; (3 per site): 5 devices, 2 values" in page.text
