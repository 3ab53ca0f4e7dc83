"""The text log format escapes control characters in messages (iotqueue/logfmt.py)."""

from __future__ import annotations

import logging
import sys

from celery.signals import after_setup_logger
from celery.utils.log import ColorFormatter

from iotqueue.logfmt import EscapingFormatter, TextFormatter, control_characters_escape

FORGED = "2026-01-01 00:00:00,000 ERROR jobs.timeline forged"


def celery_logging_set_up(logger: logging.Logger) -> None:
    """What Celery's worker sends once it has set up `logger`'s handlers."""
    after_setup_logger.send(
        sender=None, logger=logger, loglevel=logging.INFO, logfile=None, format="", colorize=False
    )


def record(message: str, *args: object, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("jobs.timeline", logging.INFO, __file__, 1, message, args, exc_info)


def test_every_control_character_is_escaped_and_other_text_is_kept():
    text = "a\nb\rc\td\x00e\x1bf\x7fg\x85h\u2028i\u2029j é 灯 \\n"

    assert control_characters_escape(text) == (
        "a\\nb\\rc\\td\\x00e\\x1bf\\x7fg\\x85h\\u2028i\\u2029j é 灯 \\n"
    )


def test_the_text_formatter_writes_one_line_per_message_from_its_arguments():
    formatter = TextFormatter("%(levelname)s %(name)s %(message)s")
    logged = record("step.failed device=%s %s", "lamp-2", f"boom\n{FORGED}")

    line = formatter.format(logged)

    assert line == f"INFO jobs.timeline step.failed device=lamp-2 boom\\n{FORGED}"
    # the record other handlers see is not changed
    assert logged.getMessage().endswith(f"boom\n{FORGED}")


def test_a_traceback_keeps_its_lines():
    try:
        raise ValueError("bad")
    except ValueError:
        logged = record("failed: %s", "x\ny", exc_info=sys.exc_info())

    text = TextFormatter("%(message)s").format(logged)

    first, *rest = text.splitlines()
    assert first == "failed: x\\ny"
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: bad"


def test_celerys_own_format_is_wrapped_when_celery_sets_up_logging(settings):
    # given a logger handled with Celery's formatter, as the worker's hijacked root logger is
    settings.IOTQUEUE_LOG_FORMAT = "text"
    logger = logging.getLogger("test-logfmt-celery")
    handler = logging.StreamHandler()
    handler.setFormatter(ColorFormatter("[%(levelname)s] %(message)s", use_color=False))
    logger.addHandler(handler)

    # when Celery announces it set the logger up
    after_setup_logger.send(
        sender=None, logger=logger, loglevel=logging.INFO, logfile=None, format="", colorize=False
    )

    # then its lines escape control characters, once
    assert isinstance(handler.formatter, EscapingFormatter)
    assert handler.format(record("%s", f"x\n{FORGED}")) == f"[INFO] x\\n{FORGED}"
    after_setup_logger.send(
        sender=None, logger=logger, loglevel=logging.INFO, logfile=None, format="", colorize=False
    )
    assert not isinstance(handler.formatter.formatter, EscapingFormatter)


def test_json_logs_are_left_to_the_json_formatter(settings):
    settings.IOTQUEUE_LOG_FORMAT = "json"
    logger = logging.getLogger("test-logfmt-json")
    handler = logging.StreamHandler()
    json_like = logging.Formatter("%(message)s")
    handler.setFormatter(json_like)
    logger.addHandler(handler)

    after_setup_logger.send(
        sender=None, logger=logger, loglevel=logging.INFO, logfile=None, format="", colorize=False
    )

    assert handler.formatter is json_like
