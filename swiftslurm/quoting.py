"""Quote once, in one place: every user value that reaches a shell script goes through here.

``shell_quote`` is the ONE quoting function (render's Jinja filter ``q``, submitit ``setup`` lines,
the local executor). ``one_line`` guards ``#SBATCH`` directive values, where a line break would
end the comment and turn the rest into a command. ``#SBATCH`` lines are read by sbatch's own
tokenizer, not by bash: it honours single and double quotes like the shell, but a backslash escapes
the next character even inside single quotes (bash keeps it), so ``sbatch_escape`` doubles every
backslash before the value is shell-quoted (by ``sbatch_directive`` here, or by submitit's shlex.quote).
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def shell_quote(value: object) -> str:
    """``value`` as one bash word that arrives literally: no expansion, no splitting, no globbing.

    Plain words stay bare (``node1``, ``/a/b.json``); anything else is single-quoted with each
    ``'`` written as ``'"'"'``. Newlines survive literally inside the quotes. NUL cannot be
    carried by any shell word and is refused.
    """
    text = str(value)
    if "\x00" in text:
        raise ValueError("a NUL byte cannot be passed through a shell script")
    if text and _SAFE.fullmatch(text):  # fullmatch: "x\n" must be quoted, not left bare
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def one_line(value: object, what: str) -> str:
    """``value`` as text with no line break (for ``#SBATCH`` lines); ValueError naming ``what`` otherwise."""
    text = str(value)
    if any(c in text for c in "\n\r\x00"):
        raise ValueError(f"{what} must be on one line (no newline, carriage return or NUL): {text!r}")
    return text


def sbatch_escape(value: object) -> str:
    """``value`` with each backslash doubled: what a quoted ``#SBATCH`` word must hold for sbatch to read ``value``."""
    return str(value).replace("\\", "\\\\")


def sbatch_directive(key: str, value: str | None) -> str:
    """One ``#SBATCH --key=value`` line whose value sbatch reads back exactly (ValueError for a line break or NUL)."""
    if value is None:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shell_quote(sbatch_escape(one_line(value, f'#SBATCH --{key}')))}"
