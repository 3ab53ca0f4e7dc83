"""MQTT topic rules: which topic names and filters a broker accepts, and which filters overlap.

Pure functions over strings (no broker, no settings), following MQTT 3.1.1 / 5 sections 1.5.3
and 4.7 and Mosquitto's `mosquitto_validate_utf8`: `+` matches exactly one level, `#` the rest
of the topic including its parent level (`a/#` matches `a`), and a filter starting with a
wildcard does not match topics whose first level starts with `$` (the broker's own `$SYS/...`).
"""

from __future__ import annotations

from itertools import zip_longest

from django.utils.translation import gettext as _

WILDCARDS = ("+", "#")
# MQTT strings carry a two-byte length: a topic is at most 65535 bytes of UTF-8.
TOPIC_MAX_BYTES = 65535
# Mosquitto refuses a topic of more levels than this (its TOPIC_HIERARCHY_LIMIT) as malformed
# and drops the client that sent it.
TOPIC_MAX_LEVELS = 200
# A shared subscription `$share/<group>/<filter>`: brokers strip the first two levels.
SHARE_PREFIX = "$share/"


def topic_text_error(text: str) -> str | None:
    """Why a broker would refuse `text` as an MQTT string, or None.

    Mosquitto (and the MQTT spec, 1.5.3) treat a topic holding any of these as a malformed
    packet and drop the connection that sent it, so one such filter in a SUBSCRIBE deafens the
    whole client: NUL and other C0 controls, DEL and C1 controls, lone surrogates (text
    that has no UTF-8 form), Unicode noncharacters, more than 65535 bytes, and more than 200 levels.
    """
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return _("the topic holds a lone surrogate, which has no UTF-8 form")
    if size > TOPIC_MAX_BYTES:
        return _("the topic is %(size)d bytes of UTF-8; MQTT allows at most %(limit)d") % {
            "size": size,
            "limit": TOPIC_MAX_BYTES,
        }
    levels = text.count("/") + 1
    if levels > TOPIC_MAX_LEVELS:
        return _("the topic has %(levels)d levels; the broker allows at most %(limit)d") % {
            "levels": levels,
            "limit": TOPIC_MAX_LEVELS,
        }
    for position, char in enumerate(text):
        problem = _character_error(ord(char))
        if problem:
            message = _("character %(position)d (U+%(code)04X) is %(problem)s, which MQTT refuses in a topic")
            return message % {
                "position": position,
                "code": ord(char),
                "problem": problem,
            }
    return None


def topic_name_error(text: str) -> str | None:
    """Why a broker would refuse `text` as a topic to publish on, or None.

    A topic name is non-empty valid text without wildcards (`+` and `#` only mean something
    in a subscription; a PUBLISH holding one is a protocol error).
    """
    if not text:
        return _("a topic cannot be empty")
    problem = topic_text_error(text)
    if problem:
        return problem
    if "+" in text or "#" in text:
        return _("a topic may not contain the wildcards + or #; they belong in subscription filters")
    return None


def topic_filter_error(text: str) -> str | None:
    """Why a broker would refuse `text` as a subscription filter, or None.

    A filter is non-empty valid text whose wildcards fill a whole level, with `#` only last.
    `$share/<group>/<filter>` is accepted when the group is one level without wildcards
    and the inner filter is itself valid.
    """
    if not text:
        return _("a topic filter cannot be empty")
    problem = topic_text_error(text)
    if problem:
        return problem
    if text.startswith(SHARE_PREFIX):
        group, _slash, inner = text[len(SHARE_PREFIX) :].partition("/")
        if not group or "+" in group or "#" in group or not inner:
            return _("a shared subscription is $share/<group>/<filter>, the group one level without + or #")
        return topic_filter_error(inner)
    levels = text.split("/")
    for position, level in enumerate(levels):
        if ("+" in level or "#" in level) and len(level) > 1:
            return _("wildcards must fill a whole level, not %(level)r") % {"level": level}
        if level == "#" and position != len(levels) - 1:
            return _("# may only be the last level")
    return None


def _character_error(code: int) -> str | None:
    """What is wrong with one code point in an MQTT string, or None."""
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return _("a control character")
    if 0xD800 <= code <= 0xDFFF:
        return _("a lone surrogate")
    if 0xFDD0 <= code <= 0xFDEF or (code & 0xFFFF) >= 0xFFFE:
        return _("a Unicode noncharacter")
    return None


def filters_overlap(first: str, second: str) -> bool:
    """True when some topic matches both filters (a plain topic is a filter without wildcards).

    Assumes both are well-formed filters (wildcards fill a whole level, `#` only last).
    """
    first_levels, second_levels = first.split("/"), second.split("/")
    if _system_topic_excluded(first_levels[0], second_levels[0]):
        return False
    for mine, theirs in zip_longest(first_levels, second_levels):
        if mine == "#" or theirs == "#":
            return True
        if mine is None or theirs is None:
            return False  # one is longer, and the shorter ended without #
        if mine != theirs and "+" not in (mine, theirs):
            return False
    return True


def _system_topic_excluded(first: str, second: str) -> bool:
    # A leading wildcard never matches a $-level, so the pair shares no topic.
    return (first in WILDCARDS and second.startswith("$")) or (second in WILDCARDS and first.startswith("$"))
