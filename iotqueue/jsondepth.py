"""How deeply a decoded JSON value nests, measured without recursion.

Python's JSON decoder and encoder recurse once per level and fail with RecursionError near
a thousand levels (less when the call stack is already deep, as in a template render):
input that nests deeply would pass every check and then fail as an HTTP 500, a task that
dies, or an admin page that never renders. So every entrance refuses nesting beyond
IOTQUEUE_JSON_MAX_DEPTH up front: the REST parser and serializer fields (iotqueue/api.py)
and device and trigger messages (devices/protocol.py).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings


def json_max_depth() -> int:
    return settings.IOTQUEUE_JSON_MAX_DEPTH


def json_too_deep(value: Any, limit: int | None = None) -> bool:
    """True when `value` nests objects and arrays more than `limit` levels deep.

    A scalar has depth 0, `{}` and `[]` depth 1, `{"a": [1]}` depth 2. Iterative, so any
    depth Python managed to decode can be measured.
    """
    limit = json_max_depth() if limit is None else limit
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth + 1 > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False
