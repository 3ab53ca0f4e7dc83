"""The inbox drain's summary (Celery's argsrepr and batch event): bounded, no row read."""

from jobs.inbox import SUMMARY_ITEMS, Work, summary_text, work_summary


def test_a_batch_summary_names_its_runs_steps_and_devices():
    # given a batch with a run start and two replies of one device
    work = Work(
        replies=[
            ["gate-1", {"kind": "ack", "command_id": "12-1-abc"}],
            ["gate-1", {"kind": "done", "command_id": "12-1-abc"}],
        ],
        starts=["7f3e"],
    )

    # when it is summarized
    text = summary_text(work_summary(work))

    # then each is named once, with the batch's size
    assert text == "size=3, runs=[7f3e], steps=[12], devices=[gate-1]"


def test_a_long_batch_summary_names_the_first_ones_then_how_many_more():
    # given replies from more devices than a summary names
    work = Work(replies=[[f"d{n}", {"command_id": f"{n}-1-x"}] for n in range(SUMMARY_ITEMS + 5)])

    # when it is summarized
    fields = work_summary(work)

    # then the first SUMMARY_ITEMS are named, then how many more
    assert fields["size"] == SUMMARY_ITEMS + 5
    assert fields["devices"].endswith(f"d{SUMMARY_ITEMS - 1}, +5 more]")
    assert fields["steps"].startswith("[0, 1, ")


def test_a_foreign_command_id_names_no_step():
    # given a reply whose command id is not the engine's (a cancel, or a device's own)
    work = Work(replies=[["lamp", {"command_id": "cancel-9-x"}], ["lamp", {}]])

    # when it is summarized
    fields = work_summary(work)

    # then the device is named, and no step
    assert fields == {"size": 2, "devices": "[lamp]"}
