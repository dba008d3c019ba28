"""Lines that a progress bar redraws in place with carriage returns (tqdm, Lightning, HF's bars).

A terminal shows only a bar's latest state; a rank's output, read line by line, would get none of it
until the bar's newline (tqdm's last), while the text held for the line grew with every redraw. Here
a line's state is what follows its last carriage return: a finished line shows its last state, and
an unfinished one is read for its current state, which the sink shows now and then (driver/output/relay.py).
Pure, so it is tested without processes.
"""

from __future__ import annotations


def last_state(line: str) -> str:
    """What a terminal would show of `line`: the text after its last carriage return that has any
    (tqdm ends a bar with `\\r<final state>\\n`; Windows' line ends leave a `\\r` at the end)."""
    if "\r" not in line:
        return line
    return next((part for part in reversed(line.split("\r")) if part), "")


def split_lines(text: str) -> tuple[list[str], str, str | None]:
    """`text` (what was held for the stream, then what arrived) as its finished lines, each as a
    terminal shows it; what is left unfinished (after a redraw, only the latest state is held); and
    the current state of a bar being redrawn (None: no redraw since the last newline)."""
    *lines, rest = text.split("\n")
    lines = [last_state(ln) for ln in lines]
    if "\r" not in rest:
        return lines, rest, None
    state = last_state(rest)
    return lines, state, state or None
