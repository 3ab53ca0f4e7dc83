"""Label selectors: parsing, errors, in-memory matching, and the database agreeing with it."""

from __future__ import annotations

import pytest

from devices.models import Device
from devices.selectors import (
    SELECTOR_MAX_LENGTH,
    Operator,
    Requirement,
    labels_requirements,
    selector_filter,
    selector_matches,
    selector_parse,
)


def test_every_requirement_form_parses():
    # when a selector uses every form Kubernetes knows
    requirements = selector_parse("site in (berlin, paris),tier notin (edge),kind=pump,k==v,x!=y,fw,!legacy")

    # then each is read as its requirement
    assert requirements == [
        Requirement("site", Operator.IN, ("berlin", "paris")),
        Requirement("tier", Operator.NOT_IN, ("edge",)),
        Requirement("kind", Operator.EQUALS, ("pump",)),
        Requirement("k", Operator.EQUALS, ("v",)),
        Requirement("x", Operator.NOT_EQUALS, ("y",)),
        Requirement("fw", Operator.EXISTS),
        Requirement("legacy", Operator.NOT_EXISTS),
    ]
    assert [str(r) for r in requirements][:3] == ["site in (berlin,paris)", "tier notin (edge)", "kind=pump"]


def test_blank_selector_has_no_requirements_and_keys_are_any_word():
    assert selector_parse("  ") == []
    assert selector_parse("a__b=1,example.com/zone=x") == [
        Requirement("a__b", Operator.EQUALS, ("1",)),
        Requirement("example.com/zone", Operator.EQUALS, ("x",)),
    ]
    assert selector_parse("mode=") == [Requirement("mode", Operator.EQUALS, ("",))]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("site in berlin", "expected '('"),
        ("site in (berlin", "expected ')'"),
        ("site in ()", "expected a value"),
        ("site=berlin,", "missing after the last ','"),
        ("site berlin", "expected =, ==, !=, in, notin"),
        ("!", "expected a label key"),
        ("=x", "expected a label key"),
        ("a=b c=d", "expected ','"),
        ("a=(b)", "expected a value"),
        ("x" * (SELECTOR_MAX_LENGTH + 1), "at most"),
    ],
)
def test_a_bad_selector_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        selector_parse(text)


LABELS = {
    "berlin-pump": {"site": "berlin", "kind": "pump"},
    "paris-legacy": {"site": "paris", "legacy": "yes"},
    "paris-lamp": {"site": "paris", "kind": "lamp"},
    "rome-pump": {"site": "rome", "kind": "pump"},
    "bare": {},
}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("site in (berlin,paris),!legacy", {"berlin-pump", "paris-lamp"}),
        ("site notin (berlin)", {"paris-legacy", "paris-lamp", "rome-pump", "bare"}),
        ("kind!=pump", {"paris-legacy", "paris-lamp", "bare"}),
        ("kind", {"berlin-pump", "paris-lamp", "rome-pump"}),
        ("kind=pump,site!=rome", {"berlin-pump"}),
        ("legacy", {"paris-legacy"}),
        ("", set(LABELS)),
    ],
)
def test_matching_in_memory(selector, expected):
    requirements = selector_parse(selector)
    assert {name for name, labels in LABELS.items() if selector_matches(requirements, labels)} == expected


def test_a_labels_dict_is_equality_requirements():
    requirements = labels_requirements({"site": "paris", "kind": "lamp"})
    matched = [name for name, labels in LABELS.items() if selector_matches(requirements, labels)]
    assert matched == ["paris-lamp"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "selector",
    [
        "site in (berlin,paris),!legacy",
        "site notin (berlin)",
        "kind!=pump",
        "kind",
        "!kind",
        "kind=pump,site!=rome",
        "site=paris,legacy==yes",
        "a__b=x",
        "contains=1",
    ],
)
def test_the_database_agrees_with_the_matcher(selector):
    # given devices with these labels (bulk_create: no broker identity is written)
    labels = {**LABELS, "odd-keys": {"a__b": "x", "contains": "1"}}
    Device.objects.bulk_create(Device(name=name, labels=value) for name, value in labels.items())
    requirements = selector_parse(selector)

    # when the database filters by the selector
    found = set(selector_filter(Device.objects.all(), requirements).values_list("name", flat=True))

    # then it finds exactly the devices the in-memory matcher accepts
    assert found == {name for name, value in labels.items() if selector_matches(requirements, value)}
