"""The text of a template version and the diff of two versions."""

from jobs.versions import snapshot_diff, snapshot_text


def snapshot(level: int, priority: int = 5) -> dict:
    return {
        "default_priority": priority,
        "steps": [{"position": 0, "device": "lamp-2", "action": "on", "args": {"level": level}}],
    }


def test_the_same_snapshot_has_no_diff():
    assert snapshot_diff(snapshot(80), snapshot(80), old_label="v1", new_label="v2") == ""


def test_a_changed_value_is_one_line_out_and_one_in():
    diff = snapshot_diff(
        snapshot(80), snapshot(60, priority=7), old_label="Morning v1", new_label="Morning v2"
    )
    lines = diff.splitlines()
    assert lines[:2] == ["--- Morning v1", "+++ Morning v2"]
    assert [line[0] + line[1:].strip() for line in lines if line.startswith(("-", "+"))][2:] == [
        '-"default_priority": 5,',
        '+"default_priority": 7,',
        '-"level": 80',
        '+"level": 60',
    ]


def test_the_text_is_stable_whatever_the_key_order():
    reordered = {"steps": snapshot(80)["steps"], "default_priority": 5}
    assert snapshot_text(reordered) == snapshot_text(snapshot(80))
