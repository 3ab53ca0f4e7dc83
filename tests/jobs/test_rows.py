"""The engine's hot-path reads and writes (jobs/rows.py) build and store what the ORM does.

Against the test database (SQLite, or PostgreSQL in CI's production leg): every field of
the row and of its attached related rows equals the ORM's select_related reading, and
reading the attached rows afterwards costs no query.
"""

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import Model
from django.utils import timezone

from devices.models import Device
from jobs.events import EVENT_FIELDS
from jobs.models import JobRun, RunEvent, StepRun, StepStatus, TemplateVersion
from jobs.rows import Writes, row_last, row_new, rows_atomic, rows_create, rows_select
from tests.factories import DeviceFactory, template_with_steps

pytestmark = pytest.mark.django_db


def fields_of(obj: Model) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


@pytest.fixture
def rows():
    device = DeviceFactory(labels=["pump", "north"])
    template = template_with_steps((device, "open", {"valve": 2}))
    run = JobRun.objects.create(template=template, plan=[{"action": "open"}], parameters={"site": "ß"})
    now = timezone.now()
    with_device = StepRun.objects.create(
        run=run,
        index=0,
        device=device,
        action="open",
        args={"valve": 2, "nested": [1, {"a": None}]},
        status=StepStatus.DISPATCHED,
        command_id="cmd-rows-1",
        fence=7,
        deadline=now + timedelta(seconds=30),
        dispatched_at=now,
        result={"ok": True},
    )
    # A row with no device (a task step's), so the device's join finds nothing.
    without_device = StepRun.objects.create(run=run, index=1, action="task", command_id="cmd-rows-2")
    return run, device, with_device, without_device


def test_step_rows_with_run_and_device_as_select_related_reads_them(rows, django_assert_num_queries):
    run, device, with_device, _ = rows
    expected = {
        s.command_id: s
        for s in StepRun.objects.select_related("run", "device").filter(
            command_id__in=["cmd-rows-1", "cmd-rows-2"]
        )
    }
    with django_assert_num_queries(1):
        got = {
            s.command_id: s
            for s in rows_select(
                StepRun, "command_id", ["cmd-rows-1", "cmd-rows-2", "none"], related=("run", "device")
            )
        }
        assert set(got) == {"cmd-rows-1", "cmd-rows-2"}
        for command_id, step in got.items():
            assert fields_of(step) == fields_of(expected[command_id])
            assert fields_of(step.run) == fields_of(run)
        assert fields_of(got["cmd-rows-1"].device) == fields_of(device)
        assert got["cmd-rows-2"].device is None
    assert got["cmd-rows-1"].deadline == with_device.deadline
    assert got["cmd-rows-1"].args == {"valve": 2, "nested": [1, {"a": None}]}
    assert got["cmd-rows-1"].run.parameters == {"site": "ß"}
    # Saved like any row read by the ORM (an UPDATE, not an INSERT).
    step = got["cmd-rows-1"]
    step.progress = 40
    step.save(update_fields=["progress"])
    assert StepRun.objects.get(pk=with_device.pk).progress == 40


def test_rows_by_primary_key_and_by_name(rows):
    run, device, with_device, _ = rows
    (by_uuid,) = rows_select(JobRun, "id", [str(run.pk)])
    assert by_uuid.pk == run.pk and fields_of(by_uuid) == fields_of(JobRun.objects.get(pk=run.pk))
    (by_id,) = rows_select(StepRun, "id", [with_device.pk], related=("run", "device"))
    assert by_id.pk == with_device.pk and by_id.run.pk == run.pk
    (by_name,) = rows_select(Device, "name", [device.name])
    assert fields_of(by_name) == fields_of(Device.objects.get(pk=device.pk))
    assert rows_select(Device, "name", []) == []
    assert rows_select(Device, "name", ["no-such-device"]) == []


def test_grouped_writes_are_checked_in_order_and_read_with_their_select(rows, django_assert_num_queries):
    """`Writes`: compare-and-set writes queued together, then sent with a read.

    On PostgreSQL the writes and the read go as one text (one query); elsewhere one each.
    Values that look like SQL or placeholders are stored as the ORM stores them.
    """
    run, device, with_device, without_device = rows
    now = timezone.now()
    tricky = {"quote": "it's", "percent": "100 %s %(x)s", "semicolon": "a;\nb", "unicode": "ß→✓"}
    with_device.status, with_device.result, with_device.finished_at = StepStatus.SUCCEEDED, tricky, now
    event = RunEvent(
        run=run, step_run=with_device, kind="step.succeeded", device=device.name, message="x;\ny"
    )
    event.data, event.created_at = {"note": "'%s'"}, now
    writes = Writes()
    writes.update(
        StepRun, [with_device], ["status", "result", "finished_at"], status_in=(StepStatus.DISPATCHED,)
    )
    writes.insert(RunEvent, [event], EVENT_FIELDS)
    one_text = connection.vendor == "postgresql"
    with django_assert_num_queries(1 if one_text else 3):
        (found,), _ = writes.send(select=(Device, "name", [device.name, "no-such-device"], ()))
    assert fields_of(found) == fields_of(Device.objects.get(pk=device.pk))
    stored = StepRun.objects.get(pk=with_device.pk)
    assert (stored.status, stored.result, stored.finished_at) == (StepStatus.SUCCEEDED, tricky, now)
    saved = RunEvent.objects.get(run=run, kind="step.succeeded")
    assert (saved.message, saved.data, saved.created_at) == ("x;\ny", {"note": "'%s'"}, now)

    # A compare-and-set that finds its row moved raises its conflict; the ones before it
    # that matched were sent as well (the caller's transaction undoes them).
    without_device.status = StepStatus.CANCELED
    with_device.progress = 50
    writes.update(
        StepRun, [without_device], ["status"], status_in=(StepStatus.PENDING,), conflict=LookupError("first")
    )
    writes.update(
        StepRun, [with_device], ["progress"], status_in=(StepStatus.DISPATCHED,), conflict=ValueError("moved")
    )
    with pytest.raises(ValueError, match="moved"):
        writes.send()
    assert StepRun.objects.get(pk=without_device.pk).status == StepStatus.CANCELED
    assert StepRun.objects.get(pk=with_device.pk).progress is None
    assert writes.send() == ([], [])  # nothing left queued


def test_reserved_ids_name_rows_inserted_whole_later_and_are_not_handed_out_again(
    rows, django_assert_num_queries
):
    """`Writes.send(reserve=...)`: ids taken before their rows exist, with the writes and the
    read in one text on PostgreSQL (the engine names its next step rows in its lock call,
    then inserts them whole); the database numbers its next row after them."""
    run, device, with_device, without_device = rows
    with_device.progress = 10
    writes = Writes()
    writes.update(StepRun, [with_device], ["progress"], status_in=(StepStatus.DISPATCHED,))
    with transaction.atomic():
        with django_assert_num_queries(1 if connection.vendor == "postgresql" else 3):
            (found,), ids = writes.send(select=(Device, "name", [device.name], ()), reserve=(StepRun, 3))
        assert found.pk == device.pk
        assert len(set(ids)) == 3 and min(ids) > without_device.pk
        now = timezone.now()
        new = [
            row_new(
                StepRun,
                pk=pk,
                run=run,
                index=5 + n,
                device=device,
                action="close",
                status=StepStatus.DISPATCHED,
                command_id=f"cmd-reserved-{n}",
                fence=3,
                dispatched_at=now,
            )
            for n, pk in enumerate(ids)
        ]
        writes.insert(StepRun, new)
        assert writes.send() == ([], [])
    assert StepRun.objects.get(pk=with_device.pk).progress == 10
    for row in new:
        assert fields_of(StepRun.objects.get(pk=row.pk)) == fields_of(row)
    # saved again as the ORM saves a row it wrote: an UPDATE
    new[0].action = "again"
    new[0].save(update_fields=["action"])
    assert StepRun.objects.get(pk=new[0].pk).action == "again"
    later = StepRun.objects.create(run=run, index=9, device=device, action="open")
    assert later.pk > max(ids)


def test_created_rows_get_their_ids_and_read_back_as_the_orm_wrote_them(rows):
    run, device, _, _ = rows
    now = timezone.now()
    new = [
        row_new(
            StepRun,
            run=run,
            index=5,
            device=device,
            action="close",
            args={"v": "50%"},
            status=StepStatus.QUEUED,
        ),
        row_new(StepRun, run=run, index=6, device=device, action="open", queued_at=now, deadline=now),
    ]
    rows_create(StepRun, new)
    assert all(row.pk for row in new)
    assert new[1].pk != new[0].pk
    for row in new:
        assert fields_of(StepRun.objects.get(pk=row.pk)) == fields_of(row)
    # the unique (run, phase, index, device) constraint still holds
    with pytest.raises(IntegrityError), transaction.atomic():
        rows_create(StepRun, [StepRun(run=run, index=5, device=device, action="again")])


def test_created_rows_with_a_uuid_key_and_auto_now_add_match_the_orms_save(rows):
    """A run (UUID primary key from its default, created_at from auto_now_add) and an event
    (numbered by the database) are written as save(force_insert=True) writes them."""
    run, _, _, _ = rows
    before = timezone.now()
    new_run = row_new(
        JobRun, template=run.template, plan=[{"action": "open"}], parameters={"n": 1}, triggered_by="t"
    )
    chosen = new_run.pk
    event = row_new(RunEvent, run=new_run, kind="run.created", data={"why": "ß"})
    rows_create(JobRun, [new_run])
    rows_create(RunEvent, [event])
    assert new_run.pk == chosen and event.pk
    assert before <= new_run.created_at <= timezone.now()
    assert fields_of(JobRun.objects.get(pk=chosen)) == fields_of(new_run)
    # Saved again as the ORM saves a row it wrote: an UPDATE (a row still marked as being
    # added, with a UUID default, would be INSERTed again and meet its primary key).
    new_run.triggered_by = "again"
    new_run.save(update_fields=["triggered_by"])
    assert JobRun.objects.get(pk=chosen).triggered_by == "again"
    assert event.pk and fields_of(RunEvent.objects.get(pk=event.pk)) == fields_of(event)


def test_the_last_row_by_a_field_is_the_orms_latest(rows):
    run, _, _, _ = rows
    template = run.template
    assert row_last(TemplateVersion, "template", template.pk, by="number") is None
    for number in (2, 7, 3):
        TemplateVersion.objects.create(
            template=template, number=number, default_priority=5, steps=[{"n": number}]
        )
    last = row_last(TemplateVersion, "template", template.pk, by="number")
    expected = template.versions.order_by("-number").first()
    assert last.number == 7 and fields_of(last) == fields_of(expected)


def in_transaction() -> bool:
    return connection.connection.info.transaction_status != 0  # psycopg: 0 is IDLE


def event_new(run: JobRun, device: Device, kind: str) -> RunEvent:
    made = RunEvent(run=run, kind=kind, device=device.name, message="")
    made.data, made.created_at = {}, timezone.now()
    return made


@pytest.mark.django_db(transaction=True)
def test_the_last_writes_of_a_transaction_carry_its_commit_only_when_nothing_is_left_to_check(rows):
    """`Writes.send(last=True)`: on PostgreSQL the text ends with the COMMIT when no row count
    is left to check and the block is a `rows_atomic` opened as the outermost; otherwise the
    block commits or rolls back as usual. Elsewhere the block always commits itself."""
    run, device, with_device, _ = rows
    postgresql = connection.vendor == "postgresql"

    def event(kind: str) -> RunEvent:
        return event_new(run, device, kind)

    writes = Writes()
    with rows_atomic():
        writes.insert(RunEvent, [event("rides")], EVENT_FIELDS)
        writes.send(last=True)
        if postgresql:
            assert not in_transaction()  # committed by the text itself
    assert RunEvent.objects.filter(kind="rides").exists()

    # a compare-and-set in the text: its count must be able to roll the block back
    with pytest.raises(LookupError), rows_atomic():
        writes.insert(RunEvent, [event("checked")], EVENT_FIELDS)
        moved = LookupError("moved")
        writes.update(StepRun, [with_device], ["progress"], status_in=(StepStatus.PENDING,), conflict=moved)
        writes.send(last=True)
    assert not RunEvent.objects.filter(kind="checked").exists()

    # a savepoint inside an outer block: the outer block decides, and here it rolls back
    with pytest.raises(RuntimeError), transaction.atomic():
        with rows_atomic():
            writes.insert(RunEvent, [event("nested")], EVENT_FIELDS)
            writes.send(last=True)
            if postgresql:
                assert in_transaction()
        raise RuntimeError("the outer block fails")
    assert not RunEvent.objects.filter(kind="nested").exists()

    # a plain atomic block is not known to be the outermost: it commits itself
    with transaction.atomic():
        writes.insert(RunEvent, [event("plain")], EVENT_FIELDS)
        writes.send(last=True)
        if postgresql:
            assert in_transaction()
    assert RunEvent.objects.filter(kind="plain").exists()


@pytest.mark.django_db(transaction=True)
def test_a_statement_failing_in_the_last_text_leaves_nothing_of_the_transaction(rows):
    """The writes of one text never half-apply: when a later statement meets a constraint
    (a real unique violation, not a stand-in), the statements before it in the same text,
    what the transaction wrote before, and the COMMIT that would have ridden along, all
    come to nothing; the connection is usable afterwards. On PostgreSQL the text is the
    one whose COMMIT rides (it has no row count to check); on SQLite the statements go one
    by one in the same transaction."""
    run, device, with_device, _ = rows
    before = StepRun.objects.count()
    writes = Writes()
    with pytest.raises(IntegrityError), rows_atomic():
        rows_create(RunEvent, [event_new(run, device, "written-before")])
        _, (first, second) = writes.send(reserve=(StepRun, 2))
        with_device.progress = 70
        writes.update(StepRun, [with_device], ["progress"], status_in=(StepStatus.DISPATCHED,))
        writes.insert(StepRun, [StepRun(pk=first, run=run, index=7, device=device, action="close")])
        writes.insert(RunEvent, [event_new(run, device, "first-in-text")], EVENT_FIELDS)
        # (run, phase, index, device) is unique: this row is with_device's twin.
        writes.insert(StepRun, [StepRun(pk=second, run=run, index=0, device=device, action="again")])
        writes.insert(RunEvent, [event_new(run, device, "after-the-failure")], EVENT_FIELDS)
        writes.send(last=True)
    if connection.vendor == "postgresql":
        assert not in_transaction()
    assert StepRun.objects.count() == before
    assert not StepRun.objects.filter(run=run, index=7).exists()
    assert StepRun.objects.get(pk=with_device.pk).progress is None
    assert not RunEvent.objects.filter(
        kind__in=["written-before", "first-in-text", "after-the-failure"]
    ).exists()
    # The same writes without the twin go through whole.
    with rows_atomic():
        writes.update(StepRun, [with_device], ["progress"], status_in=(StepStatus.DISPATCHED,))
        writes.insert(RunEvent, [event_new(run, device, "first-in-text")], EVENT_FIELDS)
        writes.send(last=True)
    assert StepRun.objects.get(pk=with_device.pk).progress == 70
    assert RunEvent.objects.filter(kind="first-in-text").count() == 1
