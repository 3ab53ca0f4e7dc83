"""{{ references }} in step args (jobs/templating.py): found, checked and rendered, lookups only."""

from __future__ import annotations

import copy
import tracemalloc

import pytest

from jobs.templating import TemplateError, references, render

CONTEXT = {
    "params": {"level": 80, "channel": "stable", "flags": {"fast": True}},
    "steps": [{"result": {"serial": "SN-7", "ports": [8080, 8443]}}],
    "device": {"name": "pump-3"},
    "run": {"id": "r-1"},
}


def test_references_are_found_anywhere_in_a_json_value():
    # given args nesting references in objects, arrays and longer strings
    args = {
        "level": "{{ params.level }}",
        "targets": ["{{device.name}}", {"serial": "SN {{ steps.0.result.serial }}!"}],
        "plain": 3,
    }

    # when their references are listed
    found = references(args)

    # then every one is found, dotted path and all, whatever the spacing
    assert sorted(found) == ["device.name", "params.level", "steps.0.result.serial"]


@pytest.mark.parametrize("value", ["{{ params.level", "{{ }}", "{{ params..level }}", "a {{ 1x }} b"])
def test_a_malformed_reference_is_an_error_naming_the_string(value):
    # when a string holds "{{" that does not form a reference, then it is refused with the string
    with pytest.raises(TemplateError, match="malformed reference"):
        references({"args": [value]})


def test_a_string_that_is_one_reference_keeps_the_value_json_type():
    # when whole-string references are rendered
    rendered = render(
        {
            "level": "{{ params.level }}",
            "flags": " {{ params.flags }} ",
            "ports": "{{ steps.0.result.ports }}",
        },
        CONTEXT,
    )

    # then numbers, objects and arrays stay what they are (surrounding blanks do not count)
    assert rendered == {"level": 80, "flags": {"fast": True}, "ports": [8080, 8443]}


def test_a_reference_inside_a_longer_string_is_formatted_into_it():
    # when references are embedded in text
    rendered = render("{{ device.name }} at {{ params.level }}% on {{ steps.0.result.ports }}", CONTEXT)

    # then strings go in as they are, anything else as JSON
    assert rendered == "pump-3 at 80% on [8080, 8443]"


def test_list_items_are_reached_by_index_and_nested_values_are_rendered():
    # when a reference indexes into lists, inside lists of objects
    rendered = render([{"port": "{{ steps.0.result.ports.1 }}"}, "{{ run.id }}", 7, None], CONTEXT)

    # then the item is found, and values without references come back unchanged
    assert rendered == [{"port": 8443}, "r-1", 7, None]


@pytest.mark.parametrize(
    ("reference", "missing"),
    [
        ("params.colour", "colour"),
        ("steps.1.result", "1"),
        ("steps.0.result.ports.9", "9"),
        ("steps.first", "first"),
        ("params.level.more", "more"),
    ],
)
def test_a_reference_without_a_value_is_an_error_naming_the_missing_part(reference, missing):
    # when a reference points past what the context holds, then the error names the part not found
    with pytest.raises(TemplateError, match=f"missing '{missing}'"):
        render({"x": f"{{{{ {reference} }}}}"}, CONTEXT)


def test_render_returns_a_copy_and_leaves_its_input_alone():
    # given args and a context
    args = {"outer": {"inner": ["{{ params.channel }}"]}}
    before = copy.deepcopy(args)

    # when they are rendered
    rendered = render(args, CONTEXT)

    # then the result is new and the template's args are untouched (a run never edits its plan)
    assert rendered == {"outer": {"inner": ["stable"]}}
    assert args == before


def test_a_render_past_its_limit_stops_before_building_the_copy():
    # given 500 references to a 60 KB parameter: 30 MB if rendered in full
    big = "x" * 60_000
    args = {"blob": " ".join(["{{ params.big }}"] * 500), "again": ["{{ params.big }}"] * 500}
    tracemalloc.start()
    try:
        # when it is rendered under a 256 KB limit
        with pytest.raises(TemplateError, match="more than 262144 bytes"):
            render(args, {"params": {"big": big}}, limit=256 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # then it stopped near the limit, never near the full 30 MB
    assert peak < 3 * 1024 * 1024


def test_a_render_within_its_limit_is_the_full_render():
    args = {"a": "{{ params.n }}", "b": "level {{ params.n }}", "c": ["{{ params.s }}"]}
    context = {"params": {"n": 5, "s": "é" * 10}}
    assert (
        render(args, context, limit=100) == render(args, context) == {"a": 5, "b": "level 5", "c": ["é" * 10]}
    )


def test_the_limit_counts_the_bytes_of_the_json_result():
    # a command goes out as ASCII JSON: 10 x "é" is 60 bytes there (\u00e9 each), not 10
    with pytest.raises(TemplateError, match="IOTQUEUE_COMMAND_MAX_BYTES"):
        render({"a": "{{ params.s }}"}, {"params": {"s": "é" * 10}}, limit=60)
    assert render({"a": "{{ params.s }}"}, {"params": {"s": "é" * 10}}, limit=70) == {"a": "é" * 10}
