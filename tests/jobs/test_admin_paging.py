"""The admin lists on big tables: estimated counts on PostgreSQL, exact ones below the threshold
and on SQLite, and searches and filters that each read an index (bench/admin_lists.py measures
them over a million step runs)."""

from __future__ import annotations

import re
import uuid

import pytest
from django.conf import settings
from django.contrib import admin
from django.contrib.auth.models import User
from django.db import connection

from jobs.admin.paging import EstimatedCountPaginator
from jobs.admin.records import FAILURE_KINDS
from jobs.admin.runs import run_id_range
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.timeline import event_tone
from tests.factories import DeviceFactory, JobTemplateFactory

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]

on_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="estimates come from PostgreSQL's planner"
)


class EstimateFromOne(EstimatedCountPaginator):
    """Every list counts as big: the estimate path without filling a table with 100,000 rows."""

    estimate_from = 1


@pytest.fixture
def boss(client) -> User:
    user = User.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(user)
    return user


@pytest.fixture
def run() -> JobRun:
    return JobRun.objects.create(template=JobTemplateFactory(), status=RunStatus.SUCCEEDED)


def events_make(run: JobRun, *kinds: str, device: str = "pump-0042") -> list[RunEvent]:
    return RunEvent.objects.bulk_create(RunEvent(run=run, kind=kind, device=device) for kind in kinds)


def paginator_line(page: str) -> str:
    """The changelist's 'N run events' line, tags and whitespace collapsed."""
    found = re.search(r'<p class="paginator">(.*?)</p>', page, re.S)
    assert found, "no paginator on the page"
    return " ".join(re.sub(r"<[^>]+>", " ", found.group(1)).split())


# --- counts -------------------------------------------------------------------------------------


def test_small_list_counts_exactly(run):
    events_make(run, "step.queued", "step.dispatched", "step.succeeded")

    paginator = EstimatedCountPaginator(RunEvent.objects.all(), 100)

    assert paginator.count == 3
    assert paginator.estimated is False


def test_changelist_shows_the_exact_count_without_about(client, boss, run):
    events_make(run, "step.queued", "step.succeeded")

    line = paginator_line(client.get("/admin/jobs/runevent/").text)

    assert line == "2 run events"


@pytest.mark.skipif(connection.vendor == "postgresql", reason="the SQLite path")
def test_sqlite_always_counts_exactly(run):
    events_make(run, "step.queued", "step.succeeded")

    paginator = EstimateFromOne(RunEvent.objects.all(), 100)

    assert (paginator.count, paginator.estimated) == (2, False)


@on_postgresql
def test_big_list_takes_postgresql_estimate(run):
    events_make(run, *["step.queued"] * 30)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_runevent")  # counts this transaction's rows as live

    paginator = EstimateFromOne(RunEvent.objects.all(), 100)

    assert paginator.count == 30
    assert paginator.estimated is True


@on_postgresql
def test_filtered_big_list_estimates_the_filter(run):
    events_make(run, *["step.queued"] * 40, *["reply.stale"] * 2)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_runevent")

    paginator = EstimateFromOne(RunEvent.objects.filter(kind="reply.stale"), 100)

    assert paginator.count == 2  # the statistics' share of the filter, not the table's size
    assert paginator.estimated is True


@on_postgresql
def test_changelist_says_about_when_it_estimates(client, boss, run, monkeypatch):
    events_make(run, *["step.queued"] * 5)
    monkeypatch.setattr(admin.site._registry[RunEvent], "paginator", EstimateFromOne)

    line = paginator_line(client.get("/admin/jobs/runevent/").text)

    assert line.startswith("about ") and line.endswith(" run events")


def test_query_that_matches_nothing_counts_zero(client, boss):
    paginator = EstimateFromOne(RunEvent.objects.filter(pk__in=[]), 100)

    assert (paginator.count, paginator.estimated) == (0, False)


# --- filters and searches ------------------------------------------------------------------


def test_failure_tone_shows_exactly_what_the_run_page_calls_failures(client, boss, run):
    kinds = ["run.failed", "step.timed_out", "schedule.failed", "step.succeeded", "step.publish_failed"]
    events_make(run, *kinds)

    page = client.get("/admin/jobs/runevent/?tone=failure").text

    shown = {kind for kind in kinds if f'<td class="field-kind">{kind}</td>' in page}
    assert shown == {kind for kind in kinds if event_tone(kind) == "failure"}


def test_failure_kinds_include_every_failure_kind_the_code_records():
    apps = [settings.BASE_DIR / app for app in ("jobs", "devices", "triggers")]
    source = "\n".join(path.read_text() for app in apps for path in app.rglob("*.py"))
    recorded = set(re.findall(r"\"([a-z_]+\.(?:failed|timed_out))\"", source))
    recorded |= {f"{family}.{status}" for family in ("run", "step") for status in ("failed", "timed_out")}
    assert recorded <= set(FAILURE_KINDS)
    assert all(event_tone(kind) == "failure" for kind in FAILURE_KINDS)


def test_step_run_search_finds_a_command_id_or_a_device_name(client, boss, run):
    pump, other = DeviceFactory(name="pump-0042"), DeviceFactory(name="pump-0043")
    rows = StepRun.objects.bulk_create(
        StepRun(
            run=run, index=i, device=device, action="check", status=StepStatus.SUCCEEDED, command_id=f"c-{i}"
        )
        for i, device in enumerate([pump, pump, other])
    )

    def found(term: str) -> set[int]:
        page = client.get("/admin/jobs/steprun/", {"q": term}).text
        return {row.pk for row in rows if f"/admin/jobs/steprun/{row.pk}/change/" in page}

    assert found("pump-0042") == {rows[0].pk, rows[1].pk}
    assert found("c-2") == {rows[2].pk}
    assert found("pump-00") == set()  # exact, not a substring


def test_run_search_by_id_prefix_idempotency_key_or_starter(client, boss):
    template = JobTemplateFactory()
    first = JobRun.objects.create(template=template, id=uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427"))
    keyed = JobRun.objects.create(template=template, idempotency_key="door-7-2024-06-11T07:00")
    started = JobRun.objects.create(template=template, triggered_by="alice")

    def found(term: str) -> set[uuid.UUID]:
        page = client.get("/admin/jobs/jobrun/", {"q": term}).text
        return {r.pk for r in (first, keyed, started) if f"/admin/jobs/jobrun/{r.pk}/change/" in page}

    assert found("1b4e28ba") == {first.pk}
    assert found("1B4E28BA-2FA1") == {first.pk}
    assert found(str(first.pk)) == {first.pk}
    assert found("door-7-2024-06-11T07:00") == {keyed.pk}
    assert found("alice") == {started.pk}
    assert found("ali") == set()


def test_run_id_range_covers_the_ids_with_that_prefix():
    low, high = run_id_range("1b4e-28")
    assert (str(low), str(high)) == (
        "1b4e2800-0000-0000-0000-000000000000",
        "1b4e28ff-ffff-ffff-ffff-ffffffffffff",
    )
    assert run_id_range("alice") is None
    assert run_id_range("") is None
    assert run_id_range("1" * 33) is None


def test_run_list_offers_fixed_date_choices_instead_of_a_hierarchy(client, boss, run):
    page = client.get("/admin/jobs/jobrun/").text

    assert "Past 7 days" in page
    assert "created_at__year" not in page
