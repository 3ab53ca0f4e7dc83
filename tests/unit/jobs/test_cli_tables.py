"""CLI tables line up by display width (wcwidth): a CJK template name takes two columns a character."""

import uuid
from datetime import timedelta

from django.utils import timezone

from jobs.cli import cell, display_width, pad, printable, run_table_lines, table_row
from jobs.models import JobRun, JobTemplate, RunStatus
from jobs.waiting import Waiting


def a_run(template: str, status: str = RunStatus.RUNNING) -> JobRun:
    now = timezone.now()
    return JobRun(
        id=uuid.uuid4(),
        template=JobTemplate(name=template),
        plan=[{"action": "on"}, {"action": "off"}],
        status=status,
        trigger="cli",
        triggered_by="ops",
        created_at=now - timedelta(minutes=9),
        started_at=now - timedelta(minutes=8),
    )


def column_of(line: str, text: str) -> int:
    """The display column at which `text` starts in `line`."""
    return display_width(line[: line.index(text)])


def test_a_chinese_template_name_keeps_the_runs_table_aligned():
    # given two runs, one of a template named in Chinese, one waiting for an offline device
    chinese, latin = a_run("晨间例程"), a_run("morning-routine")
    offline = Waiting("device_offline", "Device pump-3 is offline since 14:02:11", device="pump-3")

    # when the table is written
    header, first, second = run_table_lines([chinese, latin], {chinese.pk: offline})

    # then each column starts at the same display column in every line
    for column in ("STATUS", "TRIGGER", "WAITING"):
        value = {"STATUS": "running", "TRIGGER": "cli ops", "WAITING": "device_offline"}[column]
        assert column_of(first, value) == column_of(header, column)
        if column != "WAITING":
            assert column_of(second, value) == column_of(header, column)
    template = column_of(header, "TEMPLATE")
    assert column_of(second, "morning-routine") == column_of(first, "晨间例程") == template
    assert first.endswith("Device pump-3 is offline since 14:02:11")


def test_cells_cut_and_pad_by_display_width():
    assert cell("晨间例程", 6) == "晨间例"
    assert display_width(cell("晨间例程", 5)) == 5  # a wide character never straddles the edge
    assert cell("abc", 5, right=True) == "  abc"
    assert pad("晨间", 6) == "晨间  "
    assert pad("too long", 3) == "too long"  # pad never cuts


def test_control_characters_cannot_move_the_cursor():
    assert printable("ok\x1b[2Jgone\n") == "ok?[2Jgone?"
    assert "\x1b" not in table_row(["a\x1b[1A"], ((5, False),), "b\x07")
