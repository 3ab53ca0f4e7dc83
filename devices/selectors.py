"""Label selectors as Kubernetes writes them: `site in (berlin,paris),!legacy,kind=pump`.

A selector is comma-separated requirements, all of which a device's labels must meet:
`key=value` (or `==`), `key!=value`, `key in (a,b)`, `key notin (a,b)`, `key` (the key
exists) and `!key` (it does not). As in Kubernetes, a device without the key meets `!=`
and `notin`. `selector_parse` reads the text (ValueError saying what is wrong and where),
`selector_filter` narrows a Device queryset in SQL (SQLite and PostgreSQL alike) and
`selector_matches` checks one labels dict in memory; the two agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from django.db.models import Q, QuerySet
from django.db.models.fields.json import KeyTransform

# Stored on a step (jobs.JobStep.selector) and sent as a query parameter: a few dozen
# requirements fit, a selector pasted by mistake (a whole device list) does not.
SELECTOR_MAX_LENGTH = 1024
# Characters a key or value may not contain: they are the selector's own syntax.
_WORD = r"[^\s,()=!]+"
_TOKEN_RE = re.compile(rf"\s*(?:(?P<op>!=|==|=|!|\(|\)|,)|(?P<word>{_WORD}))")


class Operator(StrEnum):
    EQUALS = "="
    NOT_EQUALS = "!="
    IN = "in"
    NOT_IN = "notin"
    EXISTS = "exists"
    NOT_EXISTS = "!exists"


@dataclass(frozen=True)
class Requirement:
    """One condition on one label key; `values` is empty for exists / not exists."""

    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.operator == Operator.EXISTS:
            return self.key
        if self.operator == Operator.NOT_EXISTS:
            return f"!{self.key}"
        if self.operator in (Operator.IN, Operator.NOT_IN):
            return f"{self.key} {self.operator.value} ({','.join(self.values)})"
        return f"{self.key}{self.operator.value}{self.values[0]}"


def _tokens(text: str) -> list[str]:
    tokens, position = [], 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN_RE.match(text, position)
        if match is None or match.end() == position:
            raise ValueError(f"unexpected {text[position:].strip()[:20]!r} at character {position + 1}")
        tokens.append(match.group("op") or match.group("word"))
        position = match.end()
    return tokens


class _Reader:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.position = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.position += 1
        return token

    def word(self, what: str) -> str:
        token = self.take()
        if token is None or not re.fullmatch(_WORD, token):
            raise ValueError(f"expected {what}, found {'the end' if token is None else repr(token)}")
        return token


def _requirement(reader: _Reader) -> Requirement:
    if reader.peek() == "!":
        reader.take()
        return Requirement(reader.word("a label key after '!'"), Operator.NOT_EXISTS)
    key = reader.word("a label key")
    token = reader.peek()
    if token in (None, ","):
        return Requirement(key, Operator.EXISTS)
    reader.take()
    if token in ("=", "==", "!="):
        # `key=` compares with the empty value, as in Kubernetes.
        value = "" if reader.peek() in (None, ",") else reader.word(f"a value after {key}{token}")
        return Requirement(key, Operator.NOT_EQUALS if token == "!=" else Operator.EQUALS, (value,))
    if token in ("in", "notin"):
        if reader.take() != "(":
            raise ValueError(f"expected '(' after {key} {token}")
        values = [reader.word(f"a value in the set of {key} {token}")]
        while (separator := reader.take()) == ",":
            values.append(reader.word(f"a value after ',' in the set of {key} {token}"))
        if separator != ")":
            raise ValueError(f"expected ')' to close the set of {key} {token}")
        return Requirement(key, Operator.IN if token == "in" else Operator.NOT_IN, tuple(values))
    raise ValueError(f"after {key!r} expected =, ==, !=, in, notin, ',' or the end, found {token!r}")


def selector_parse(text: str) -> list[Requirement]:
    """The requirements of a selector; [] for a blank one (which matches every device).

    Raises ValueError saying what is wrong, fit for a 400 answer.
    """
    if len(text) > SELECTOR_MAX_LENGTH:
        raise ValueError(f"a selector has at most {SELECTOR_MAX_LENGTH} characters")
    reader = _Reader(_tokens(text))
    requirements: list[Requirement] = []
    while reader.peek() is not None:
        requirements.append(_requirement(reader))
        token = reader.take()
        if token not in (None, ","):
            raise ValueError(f"expected ',' between requirements, found {token!r}")
        if token == "," and reader.peek() is None:
            raise ValueError("a requirement is missing after the last ','")
    return requirements


def labels_requirements(labels: dict[str, str]) -> list[Requirement]:
    """A labels dict ({"kind": "pump"}) as the equality requirements it always meant."""
    return [Requirement(key, Operator.EQUALS, (value,)) for key, value in labels.items()]


def selector_matches(requirements: list[Requirement], labels: dict[str, str]) -> bool:
    """Whether a device with these labels meets every requirement."""
    for requirement in requirements:
        present = requirement.key in labels
        value = labels.get(requirement.key)
        met = {
            Operator.EQUALS: present and value in requirement.values,
            Operator.IN: present and value in requirement.values,
            Operator.NOT_EQUALS: not present or value not in requirement.values,
            Operator.NOT_IN: not present or value not in requirement.values,
            Operator.EXISTS: present,
            Operator.NOT_EXISTS: not present,
        }[requirement.operator]
        if not met:
            return False
    return True


def selector_filter(queryset: QuerySet, requirements: list[Requirement]) -> QuerySet:
    """The queryset's devices that meet every requirement, decided by the database.

    A key is always one JSON key, never a lookup path: `has_key` takes it as a value, and
    comparisons go through KeyTransform, so `a__b` or `contains` is a key like any other.
    """
    for n, requirement in enumerate(requirements):
        name = f"selector_{n}"
        has_key = Q(labels__has_key=requirement.key)
        if requirement.operator in (Operator.EXISTS, Operator.NOT_EXISTS):
            queryset = queryset.filter(has_key if requirement.operator == Operator.EXISTS else ~has_key)
            continue
        queryset = queryset.alias(**{name: KeyTransform(requirement.key, "labels")})
        among = Q(**{f"{name}__in": requirement.values})
        if requirement.operator in (Operator.EQUALS, Operator.IN):
            queryset = queryset.filter(has_key & among)
        else:
            # A missing key yields SQL NULL, which NOT IN would drop: Kubernetes keeps it.
            queryset = queryset.filter(~has_key | (has_key & ~among))
    return queryset
