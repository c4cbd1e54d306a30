"""Quote once, in one place: every user value that reaches a shell script goes through here.

``shell_quote`` is the ONE quoting function (render's Jinja filter ``q``, submitit ``setup`` lines,
the local executor). ``one_line`` guards ``#SBATCH`` directive values, where a line break would
end the comment and turn the rest into a command.
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def shell_quote(value: object) -> str:
    """``value`` as one bash word that arrives literally: no expansion, no splitting, no globbing.

    Plain words stay bare (``node1``, ``/a/b.json``); anything else is single-quoted with each
    ``'`` written as ``'"'"'``. Newlines survive literally inside the quotes. NUL cannot be
    carried by any shell word and is refused.
    """
    text = str(value)
    if "\x00" in text:
        raise ValueError("a NUL byte cannot be passed through a shell script")
    if text and _SAFE.match(text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def one_line(value: object, what: str) -> str:
    """``value`` as text with no line break (for ``#SBATCH`` lines); ValueError naming ``what`` otherwise."""
    text = str(value)
    if any(c in text for c in "\n\r\x00"):
        raise ValueError(f"{what} must be on one line (no newline, carriage return or NUL): {text!r}")
    return text
