"""``deepspeed.utils.numa``: reading a core list such as ``--bind_core_list 0,2-4,6`` the way DeepSpeed's
launcher does (strictly ascending, non-overlapping sub-ranges)."""
from __future__ import annotations

__all__ = ["parse_range", "parse_range_list"]


def parse_range(rng: str) -> range:
    """``"5"`` -> ``range(5, 6)``; ``"2-4"`` -> ``range(2, 5)`` (both ends included)."""
    text = rng.strip()
    if text.isdigit():
        return range(int(text), int(text) + 1)
    low, sep, high = text.partition("-")
    if not (sep and low.isdigit() and high.isdigit()):
        raise ValueError(f"Bad range: {rng!r}; a range is a number or two numbers joined by a dash (2-4)")
    if int(low) > int(high):
        raise ValueError(f"Bad range: {rng!r}; the end must not be below the start (write {high}-{low})")
    return range(int(low), int(high) + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``; the sub-ranges must ascend and not overlap."""
    numbers: list[int] = []
    for piece in range_str.split(","):
        sub = parse_range(piece)
        if numbers and sub[0] <= numbers[-1]:
            raise ValueError(f"Bad range: {range_str!r}; sub-ranges must ascend and not overlap "
                             f"({piece!r} starts at or below {numbers[-1]})")
        numbers.extend(sub)
    return numbers
