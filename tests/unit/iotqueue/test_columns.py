"""Terminal columns by display width: Chinese names line up with ASCII ones."""

from __future__ import annotations

from iotqueue.columns import columns_line, text_fit, text_pad, text_width


def test_a_chinese_character_takes_two_columns():
    # given a Chinese template name and an ASCII one
    # then the Chinese one takes twice its code points, the ASCII one its length
    assert text_width("晨间例程") == 8
    assert text_width("Morning") == 7
    assert text_width("é") == 1 and text_width("e\u0301") == 1  # a combining accent takes none


def test_lines_with_chinese_and_ascii_names_align():
    # given two table lines, one with a Chinese name, one with an ASCII name
    lines = [
        columns_line([("0a1b2c3d", 8, "<"), (name, 12, "<"), ("running", 10, "<"), ("1/2", 5, ">")])
        for name in ("晨间例程", "Morning")
    ]

    # then every column after the name starts at the same display column
    assert text_width(lines[0]) == text_width(lines[1])
    assert lines[0].index("running") + 4 == lines[1].index("running")  # 4 wide characters, 8 columns


def test_a_long_name_is_cut_to_its_column_without_halving_a_wide_character():
    # given a name wider than its column
    # when it is fitted to 7 columns
    fitted = text_fit("晨间例程名称", 7)

    # then it takes at most 7 columns, ends in an ellipsis, and keeps whole characters
    assert fitted == "晨间例…" and text_width(fitted) == 7
    assert text_fit("short", 7) == "short"


def test_right_alignment_pads_on_the_left():
    assert text_pad("进度", 6, ">") == "  进度"
    assert text_pad("abc", 2) == "abc"
