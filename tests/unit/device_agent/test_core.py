"""The device's protocol rules (iotqueue_device.core), without sockets: every verdict of
docs/protocol.md's "Late commands", duplicates, cancel, jobs/current and a reboot."""

from __future__ import annotations

import json

import pytest
from iotqueue_device.core import FINISHED_KEPT, CommandBook, Verdict
from iotqueue_device.protocol import ProtocolError, command_parse, current_parse

NOW = 1_790_000_000.0  # 2026-09-21
LATER = "2027-01-15T08:00:00+00:00"  # after NOW
EARLIER = "2020-01-01T00:00:00+00:00"  # before NOW


def command(command_id: str, token: int | None = 1, *, deadline: str = LATER, action: str = "flash", **args):
    body = {"id": command_id, "run": "r", "step": 0, "attempt": 1, "token": token, "action": action}
    return command_parse({**body, "args": args, "deadline": deadline})


def test_a_new_command_runs_and_its_done_is_sent_once():
    # given a device that has seen nothing
    book = CommandBook()

    # when a command arrives and its handler finishes
    decision = book.command(command("c1"), NOW)
    sent = book.finish("c1", {"id": "c1", "ok": True, "result": {}})

    # then it ran, its done is to be sent, and a second finish sends nothing
    assert (decision.verdict, decision.superseded, decision.resumed) == (Verdict.RUN, (), False)
    assert sent and not book.finish("c1", {"id": "c1", "ok": True})


def test_a_duplicate_in_flight_goes_on_and_a_finished_one_is_answered_again():
    # given one command in flight and one finished
    book = CommandBook()
    book.command(command("c1", 1), NOW)
    book.finish("c1", {"id": "c1", "ok": True, "result": {"n": 1}})
    book.command(command("c2", 2), NOW)

    # when both arrive again
    running, finished = book.command(command("c2", 2), NOW), book.command(command("c1", 1), NOW)

    # then neither runs again: the finished one's done is replayed verbatim
    assert (running.verdict, running.replay) == (Verdict.DUPLICATE, None)
    assert (finished.verdict, finished.replay) == (
        Verdict.DUPLICATE,
        {"id": "c1", "ok": True, "result": {"n": 1}},
    )


def test_a_lower_token_is_stale_and_a_passed_deadline_expired_neither_answered_later():
    # given a device that has seen token 5
    book = CommandBook()
    book.command(command("c5", 5), NOW)

    # when a command with token 4 arrives, then one with token 6 whose deadline has passed
    stale = book.command(command("c4", 4), NOW)
    expired = book.command(command("c6", 6, deadline=EARLIER), NOW)

    # then neither starts, and a redelivery of either is a duplicate with nothing to replay
    assert stale.verdict is Verdict.STALE and "below 5" in stale.reason
    assert expired.verdict is Verdict.EXPIRED
    assert book.command(command("c4", 4), NOW).replay is None
    assert list(book.flights) == ["c5"]


def test_a_device_without_a_clock_skips_the_deadline_rule():
    assert CommandBook().command(command("c1", deadline=EARLIER), None).verdict is Verdict.RUN


def test_a_higher_token_supersedes_the_command_in_flight():
    # given a command in flight with token 3
    book = CommandBook()
    book.command(command("c3", 3), NOW)

    # when token 4 arrives
    decision = book.command(command("c4", 4), NOW)

    # then c4 runs, c3 stops without a done (finish says so) and was live when c4 came
    assert (decision.verdict, decision.superseded, decision.live) == (Verdict.RUN, ("c3",), ("c3",))
    assert not book.finish("c3", {"id": "c3", "ok": True})
    assert book.command(command("c3", 3), NOW).verdict is Verdict.DUPLICATE


def test_a_cancel_names_its_target_and_is_exempt_from_the_token_rule():
    # given a device at token 7 running c7
    book = CommandBook()
    book.command(command("c7", 7), NOW)

    # when a cancel for c7 carries c7's token, and arrives twice
    cancel = command("x7", 7, action="cancel", id="c7")
    first = book.command(cancel, NOW)
    book.abandon("c7", {"id": "c7", "ok": False, "error": "canceled"})
    book.remember("x7", {"id": "x7", "ok": True, "result": {"canceled": True}})
    again = book.command(cancel, NOW)

    # then the first is a cancel of c7, the second a duplicate answered with the same done
    assert (first.verdict, first.target) == (Verdict.CANCEL, "c7")
    assert (again.verdict, again.replay["id"]) == (Verdict.DUPLICATE, "x7")
    assert book.command(command("c7", 7), NOW).replay == {"id": "c7", "ok": False, "error": "canceled"}


def test_jobs_current_null_ends_what_ran_before_the_question_not_what_came_after():
    # given c1 in flight, then the question asked, then c2 (token 2) arrives before the answer
    book = CommandBook()
    book.command(command("c1", 1), NOW)
    book.asked()
    book.command(command("c2", 1), NOW)

    # when the answer says nothing is in flight
    decision = book.current(None, NOW)

    # then c1 stops without a done; c2 (newer than the answer) goes on
    assert (decision.verdict, decision.superseded) == (Verdict.IDLE, ("c1",))
    assert list(book.flights) == ["c2"]


def test_jobs_current_naming_the_running_command_changes_nothing():
    book = CommandBook()
    book.command(command("c1", 1), NOW)
    assert book.current(command("c1", 1), NOW).verdict is Verdict.DUPLICATE


def test_after_a_reboot_the_saved_command_waits_for_jobs_current_then_resumes_once():
    # given a device that saved its state mid-command and after finishing another
    before = CommandBook()
    before.command(command("c1", 1), NOW)
    before.finish("c1", {"id": "c1", "ok": True, "result": {}})
    before.command(command("c2", 2), NOW)
    saved = json.loads(json.dumps(before.snapshot()))

    # when it boots from that state and jobs/current names c2 (with a later deadline), then c1
    book = CommandBook.restore(saved)
    waiting = [flight.running for flight in book.flights.values()]
    resumed = book.current(command("c2", 2, deadline="2027-02-01T00:00:00+00:00"), NOW)
    again = book.current(command("c2", 2), NOW)
    finished = book.current(command("c1", 1), NOW)

    # then c2 was held until confirmed, resumes once, and c1 is not run twice (its done replayed)
    assert waiting == [False]
    assert (resumed.verdict, resumed.resumed) == (Verdict.RUN, True)
    assert again.verdict is Verdict.DUPLICATE
    assert (finished.verdict, finished.replay["id"]) == (Verdict.DUPLICATE, "c1")
    # and the fence survived: token 1 for a new id is stale
    assert book.command(command("c0", 1), NOW).verdict is Verdict.STALE


def test_after_a_reboot_a_higher_token_supersedes_the_saved_command():
    before = CommandBook()
    before.command(command("c2", 2), NOW)
    book = CommandBook.restore(before.snapshot())
    decision = book.command(command("c3", 3), NOW)
    assert (decision.verdict, decision.superseded) == (Verdict.RUN, ("c2",))


def test_a_power_cut_without_a_state_file_lets_jobs_current_hand_the_command_back():
    # given a device (the simulator's model) that forgets its flights, not its fence
    book = CommandBook()
    book.command(command("c3", 3), NOW)
    assert book.forget_flights() == ["c3"]

    # when jobs/current names the command it was executing
    decision = book.current(command("c3", 3), NOW)

    # then it runs again, as a resumption
    assert (decision.verdict, decision.resumed) == (Verdict.RUN, True)


def test_the_finished_ids_are_bounded():
    book = CommandBook()
    for n in range(FINISHED_KEPT + 10):
        book.command(command(f"c{n}", n), NOW)
        book.finish(f"c{n}", {"id": f"c{n}", "ok": True})
    assert len(book.finished) == FINISHED_KEPT and "c0" not in book.finished


def test_an_extension_keeps_the_command_live_past_its_deadline():
    book = CommandBook()
    book.command(command("c1", 1, deadline="2027-01-15T08:00:00+00:00"), NOW)
    deadline = book.flights["c1"].live_until
    book.extend("c1", deadline + 600)
    assert book.live(deadline + 300) == ["c1"] and book.live(deadline + 601) == []


def test_restore_refuses_a_snapshot_of_another_version():
    with pytest.raises(ValueError):
        CommandBook.restore({"version": 99})


@pytest.mark.parametrize(
    "body",
    [[], {"id": ""}, {"id": 5}, {"id": "c", "args": [1]}],
)
def test_malformed_commands_are_refused(body):
    with pytest.raises(ProtocolError):
        command_parse(body)


def test_a_jobs_current_answer_is_parsed():
    assert current_parse(b'{"command": null, "queued": 0}') is None
    named = current_parse(b'{"command": {"id": "c1", "token": 3, "action": "on", "args": {}}, "queued": 1}')
    assert (named.id, named.token, named.action) == ("c1", 3, "on")
    with pytest.raises(ProtocolError):
        current_parse(b'{"queued": 1}')
