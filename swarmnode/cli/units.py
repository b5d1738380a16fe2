"""Figures as people read them: durations, sizes, rates and fractions, rounded, with their units."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """`0.000134` -> "0.13 ms", `0.134` -> "134 ms", `4.2` -> "4.2 s", `192` -> "3 min 12 s",
    `7380` -> "2 h 03 min"."""
    if seconds < 0.001:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s"
    hours, minutes = divmod(round(seconds) // 60, 60)
    return f"{hours} h {minutes:02d} min"


def size(count: int) -> str:
    """Bytes in kB, MB or GB (powers of 1000), one decimal."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def rate(per_second: float, unit: str) -> str:
    """`1937.4, "tokens"` -> "1,937 tokens/s"."""
    return f"{per_second:,.0f} {unit}/s" if per_second >= 10 else f"{per_second:.2f} {unit}/s"


def percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%" if fraction in (0, 1) or fraction >= 0.1 else f"{fraction * 100:.1f}%"
