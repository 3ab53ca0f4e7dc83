"""Text columns for terminals, measured in display columns, not code points.

A Chinese character takes two columns of a terminal (and combining marks none), so padding by
len() shifts every column after a Chinese template name: 晨间例程 is 4 code points and 8
columns. These functions pad and cut by the width wcwidth gives, as terminals draw it.
"""

from __future__ import annotations

from wcwidth import wcswidth, wcwidth

ELLIPSIS = "…"


def text_width(text: str) -> int:
    """How many terminal columns `text` takes (a control character counts as none)."""
    width = wcswidth(text)
    if width >= 0:
        return width
    return sum(max(wcwidth(character), 0) for character in text)


def text_fit(text: str, width: int) -> str:
    """`text` cut to at most `width` columns, ending in … when cut (a wide character is never halved)."""
    if text_width(text) <= width:
        return text
    kept, used = [], 0
    for character in text:
        columns = max(wcwidth(character), 0)
        if used + columns > width - 1:
            break
        kept.append(character)
        used += columns
    return "".join(kept) + ELLIPSIS


def text_pad(text: str, width: int, align: str = "<") -> str:
    """`text` padded with spaces to `width` columns: "<" left-aligned, ">" right-aligned.

    Text wider than `width` is returned whole, as str.format does (cut it with text_fit first).
    """
    fill = " " * max(width - text_width(text), 0)
    return fill + text if align == ">" else text + fill


def columns_line(cells: list[tuple[str, int, str]], separator: str = "  ") -> str:
    """One table line from (text, width, align) cells, trailing spaces stripped.

    A width of 0 leaves the cell unpadded (the last column, free text).
    """
    padded = (text_pad(text, width, align) if width else text for text, width, align in cells)
    return separator.join(padded).rstrip()
