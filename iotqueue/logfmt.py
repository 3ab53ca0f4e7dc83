"""The text log format: control characters in a message are escaped, so a line is one line.

Devices choose much of what is logged (a `done`'s error, a progress detail, a dropped
message's topic, a device's name), and a newline in it would otherwise start a line of the
device's making, e.g. a forged `ERROR` line. In text logs every control character of a
message — C0 and C1 (newline, carriage return, tab, escape, NEL …), DEL and the Unicode
line and paragraph separators — is written as a backslash escape (`\\n`, `\\x1b`,
`\\u2028`). A traceback after the message keeps its lines. JSON logs escape in JSON already
and are left alone.

Celery's worker and beat replace the root logger's handlers with their own text format
(CELERY_WORKER_HIJACK_ROOT_LOGGER in text mode): `_celery_formatters_escape` wraps their
formatters once Celery has set them up. This module is imported wherever Django's LOGGING
is configured (its text formatter is `TextFormatter`), which in the worker and beat is
before Celery sets up its logging (Celery's Django fixup runs `django.setup()` first).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from celery.signals import after_setup_logger, after_setup_task_logger
from django.conf import settings

# Every C0 and C1 control character, DEL, and the line and paragraph separators (which some
# log viewers and JSON-unaware tools break lines at).
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    character = match.group()
    if character in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[character]
    code = ord(character)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def control_characters_escape(text: str) -> str:
    """`text` with every control character written as a backslash escape."""
    return CONTROL_CHARACTERS.sub(_escape, text)


def record_escaped(record: logging.LogRecord) -> logging.LogRecord:
    """`record` itself when its message has no control character, else a copy whose message
    is escaped (the record is shared by every handler, so it is never changed)."""
    message = record.getMessage()
    if not CONTROL_CHARACTERS.search(message):
        return record
    copy = logging.makeLogRecord(record.__dict__)
    copy.msg, copy.args = control_characters_escape(message), None
    return copy


class TextFormatter(logging.Formatter):
    """logging's Formatter, writing the message with its control characters escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record_escaped(record))


class EscapingFormatter(logging.Formatter):
    """Another formatter (Celery's), given messages with their control characters escaped."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__()
        self.formatter = formatter

    def format(self, record: logging.LogRecord) -> str:
        return self.formatter.format(record_escaped(record))


@after_setup_logger.connect
@after_setup_task_logger.connect
def _celery_formatters_escape(logger: logging.Logger, **kwargs: Any) -> None:
    """Celery set up `logger`'s handlers with its own text format: escape their messages."""
    if settings.IOTQUEUE_LOG_FORMAT != "text":
        return  # Celery left Django's JSON handler in place
    for handler in logger.handlers:
        formatter = handler.formatter or logging.Formatter()
        if not isinstance(formatter, (TextFormatter, EscapingFormatter)):
            handler.setFormatter(EscapingFormatter(formatter))
