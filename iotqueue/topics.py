"""MQTT topic filter algebra: whether two subscription filters can match a common topic.

Pure functions over strings (no broker, no settings), following MQTT 3.1.1 / 5 section 4.7:
`+` matches exactly one level, `#` the rest of the topic including its parent level
(`a/#` matches `a`), and a filter starting with a wildcard does not match topics whose
first level starts with `$` (the broker's own `$SYS/...`).
"""

from __future__ import annotations

from itertools import zip_longest

WILDCARDS = ("+", "#")


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
