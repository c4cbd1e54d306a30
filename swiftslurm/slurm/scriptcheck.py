"""Does the batch script parse, and does it reach its srun line? Checked at ``validate``, never on a node.

``slurm.setup`` lines are the user's shell, written verbatim into the batch script before the ``srun`` that
starts the ranks (and into submitit's script, and the local executor's ``bash -c``). A broken line there
costs a queue wait to find out; some do worse: an unterminated here-document (``cat <<EOF``) swallows every
later line, and ``exit`` or ``exec`` ends the batch shell early, so the job ends COMPLETED with no rank
started. Three checks, none of which runs a line of the user's code:

1. ``bash -n`` (parse only, never execute: a file argument, so never interactive; an empty environment, so
   no ``BASH_ENV``) over the setup lines alone: they must be a complete list of commands: no syntax error,
   no quote, ``if``, ``$(`` or operator left open, no here-document delimited by the end of the file.
2. The same lines followed by a sentinel line ``then``: a reserved word is a syntax error only where a new
   command starts, so bash must refuse it on exactly that line. It does not when the setup swallows the
   next line (a here-document, a quote, a trailing backslash that joins the next line to the last command).
3. A scan of the command words (quotes, escapes, comments and here-document bodies understood): no
   ``exit``/``logout`` but a failing ``exit N`` (N a literal 1..255: the job ends FAILED, as a guard means), no
   ``exec`` of a command (``exec >log 2>&1`` only redirects and is fine), no
   ``set -n``/``set -o noexec``, and no function or alias named after a command the script runs after
   the setup (``srun() { :; }`` would replace the launch).

Then every rendered script as a whole must pass ``bash -n``. Each failure is one Problem naming the setup
entry (``slurm.setup[2]``) and its text.
"""

from __future__ import annotations

import bisect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from ..errors import Problem

SENTINEL = "then"
BASH_TIMEOUT_S = 20
MAX_PROBES = 300  # bash -n runs to find the line that opens what never closes (only when something does)
# what the rendered script (and submitit's) runs after the setup lines: a function or alias of one of these
# names in the setup would run instead
SCRIPT_COMMANDS = ("srun", "wait", "kill", "trap", "export", "echo", "exit", "[", "test")
ENDS_SCRIPT = ("exit", "logout")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?\+?=")
_IO_NAME = re.compile(r"[0-9]+|\{[A-Za-z_][A-Za-z0-9_]*\}")
_LINE = re.compile(r"line (\d+): (.*)")
_HEREDOC_WARNING = re.compile(r"here-document at line (\d+) delimited by end-of-file")
_EOF_WORDS = ("unexpected end of file", "unexpected EOF")


@dataclass(frozen=True)
class BashVerdict:
    rc: int
    stderr: str

    @property
    def clean(self) -> bool:
        return self.rc == 0 and not self.stderr.strip()

    def first(self) -> tuple[int | None, str]:
        """(line, message) of bash's first complaint."""
        for raw in self.stderr.splitlines():
            m = _LINE.search(raw)
            if m and not m.group(2).startswith("warning:"):
                return int(m.group(1)), m.group(2).strip()
        return None, self.stderr.strip()[:200] or f"bash -n exited {self.rc}"


def bash_n(text: str) -> BashVerdict:
    """``bash -n`` over ``text``: parse only. The text goes in as a file (bash reading a file is never
    interactive, and ``-n`` then executes nothing); an empty environment keeps BASH_ENV and the profile out."""
    with tempfile.TemporaryDirectory(prefix="swiftslurm-bash-n-") as tmp:
        path = os.path.join(tmp, "script.sh")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            proc = subprocess.run(["bash", "--noprofile", "--norc", "-n", path], capture_output=True, text=True,
                                  errors="replace", timeout=BASH_TIMEOUT_S, env={"LC_ALL": "C", "PATH": os.defpath},
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            return BashVerdict(0, "")  # no bash here: the node's sbatch would say; nothing to check against
        except subprocess.TimeoutExpired:
            return BashVerdict(124, f"line 1: bash -n did not finish within {BASH_TIMEOUT_S} s")
    return BashVerdict(proc.returncode, proc.stderr.replace(path, "script"))


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _at(setup: list[str], line: int | None) -> int:
    """A 1-based line of the probe as an index into ``setup`` (clamped)."""
    if not line:
        return len(setup) - 1
    return min(max(line, 1), len(setup)) - 1


def _problem(setup: list[str], index: int, what: str, hint: str) -> Problem:
    return Problem(f"slurm.setup[{index}]", what, repr(setup[index]), hint)


def _opener(setup: list[str]) -> int:
    """The entry that opens what never closes: the one after the longest prefix that still parses (looked for
    among the last MAX_PROBES prefixes: a few ms each)."""
    for k in range(len(setup) - 1, max(0, len(setup) - MAX_PROBES), -1):
        if bash_n(_text(setup[:k])).clean:
            return k
    return 0 if len(setup) <= MAX_PROBES else len(setup) - 1


def parse_problems(setup: list[str]) -> list[Problem]:
    """Checks 1 and 2: the setup lines as a complete list of commands that leaves the next line a command."""
    if not setup:
        return []
    alone = bash_n(_text(setup))
    if not alone.clean:
        heredoc = _HEREDOC_WARNING.search(alone.stderr)
        if heredoc:
            i = _at(setup, int(heredoc.group(1)))
            return [_problem(setup, i, "an unterminated here-document: it swallows every later line of the batch script, "
                             "the srun line too, so the job would end COMPLETED without starting a rank",
                             "end it with its delimiter line as its own setup entry (cat <<EOF ... then \"EOF\"), or write "
                             "the file with printf")]
        line, message = alone.first()
        eof = any(word in message for word in _EOF_WORDS)
        i = _opener(setup) if eof and "matching `'" not in message and 'matching `"' not in message else _at(setup, line)
        what = "bash cannot parse the setup" + (" (something opened here is never closed)" if eof else "")
        return [_problem(setup, i, f"{what}: {message}",
                         "each setup entry is one line of bash run before the ranks start; balance quotes, "
                         "if/fi, do/done and $( ) within the setup")]
    probe = bash_n(_text([*setup, SENTINEL]))
    expected = f"line {len(setup) + 1}: syntax error near unexpected token `{SENTINEL}'"
    if expected not in probe.stderr:
        i = next((k - 1 for k in range(max(1, len(setup) + 1 - MAX_PROBES), len(setup) + 1)
                  if bash_n(_text(setup[:k])).clean and f"line {k + 1}: syntax error near unexpected token `{SENTINEL}'"
                  not in bash_n(_text([*setup[:k], SENTINEL])).stderr), len(setup) - 1)
        return [_problem(setup, i, "this setup line carries on into the lines after it (a trailing backslash, or a "
                         "construct that swallows the next line): the batch script's own lines, srun included, would "
                         "not run as commands", "end the setup with a complete command on its own line")]
    return []


# ---------------------------------------------------------------- the command words


@dataclass(frozen=True)
class _Token:
    kind: str  # "word" | "op"
    value: str  # a word without its quotes (an approximation: expansions stay as written); an operator
    line: int  # 1-based line of the setup text
    start: int
    end: int
    quoted: bool = False


_OPS = (";;&", "&>>", "<<-", "<<<", ";&", ";;", "&&", "||", "|&", "&>", ">>", "<<", "<>", ">&", "<&", ">|",
        ";", "&", "|", "(", ")", "<", ">", "\n")
_REDIRECTIONS = {"&>>", "&>", ">>", "<<<", "<>", ">&", "<&", ">|", "<", ">", "<<", "<<-"}
_RESERVED = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time", "esac"}


def _skip_group(text: str, i: int, close: str) -> int:
    """Index after the ``close`` that ends a ``$(``/``${``/``$((`` group opened just before ``i`` (nesting and quotes)."""
    opener = {")": "(", "}": "{"}[close]
    depth = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            j = text.find("'", i + 1)
            i = len(text) if j < 0 else j + 1
            continue
        if c == '"':
            i = _skip_double(text, i + 1)
            continue
        if c == opener:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _skip_double(text: str, i: int) -> int:
    """Index after the ``"`` that closes a double-quoted string starting at ``i``."""
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        elif text.startswith("$(", i):
            i = _skip_group(text, i + 2, ")")
        elif text.startswith("${", i):
            i = _skip_group(text, i + 2, "}")
        elif c == "`":
            j = text.find("`", i + 1)
            i = len(text) if j < 0 else j + 1
        else:
            i += 1
    return i


def tokens(text: str) -> list[_Token]:
    """The setup text as words and operators; comments and here-document bodies dropped."""
    out: list[_Token] = []
    pending: list[tuple[str, bool]] = []  # here-documents whose bodies start after this line: (delimiter, strip tabs)
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        line = bisect.bisect_right(starts, i)
        if c in " \t":
            i += 1
            continue
        if c == "\\" and text.startswith("\\\n", i):
            i += 2
            continue
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        op = next((o for o in _OPS if text.startswith(o, i)), None)
        if op is not None:
            out.append(_Token("op", op, line, i, i + len(op)))
            i += len(op)
            if op == "\n" and pending:  # the bodies of the here-documents opened on this line
                for delimiter, strip in pending:
                    while i < n:
                        j = text.find("\n", i)
                        body_line = text[i: n if j < 0 else j]
                        i = n if j < 0 else j + 1
                        if (body_line.lstrip("\t") if strip else body_line) == delimiter:
                            break
                pending = []
            if op in ("<<", "<<-"):
                word, i2 = _word(text, i, starts)
                if word is not None:
                    pending.append((word.value, op == "<<-"))
                    out.append(word)
                    i = i2
            continue
        word, i = _word(text, i, starts)
        if word is not None:
            out.append(word)
    return out


def _word(text: str, i: int, starts: list[int]) -> tuple[_Token | None, int]:
    """One word from ``i`` (blanks before it skipped): its unquoted value and where it ends. ``starts``: where each
    line of ``text`` starts."""
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    start, value, quoted = i, [], False
    line = bisect.bisect_right(starts, i)
    while i < n:
        c = text[i]
        if c in " \t\n;&|()<>":
            break
        if c == "\\":
            if i + 1 < n and text[i + 1] != "\n":
                value.append(text[i + 1])
            quoted = True
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            j = n if j < 0 else j
            value.append(text[i + 1: j])
            quoted, i = True, j + 1
        elif text.startswith("$'", i):
            j = i + 2
            while j < n and text[j] != "'":
                j += 2 if text[j] == "\\" else 1
            value.append(text[i: j + 1])
            quoted, i = True, j + 1
        elif c == '"':
            j = _skip_double(text, i + 1)
            value.append(text[i + 1: j - 1])
            quoted, i = True, j
        elif text.startswith("$(", i) or text.startswith("${", i):
            j = _skip_group(text, i + 2, ")" if text[i + 1] == "(" else "}")
            value.append(text[i:j])
            i = j
        elif c == "`":
            j = text.find("`", i + 1)
            j = n if j < 0 else j + 1
            value.append(text[i:j])
            i = j
        else:
            value.append(c)
            i += 1
    if i == start:
        return None, i
    return _Token("word", "".join(value), line, start, i, quoted), i


def commands(text: str) -> list[tuple[int, list[str], bool]]:
    """The simple commands of ``text``: (line, words without assignments and redirections, is a function
    definition). Reserved words start a new command; ``case ... in`` words are not commands."""
    out: list[tuple[int, list[str], bool]] = []
    toks = tokens(text)
    words: list[str] = []
    line = 1
    skip_until_in = False
    k = 0

    def flush(definition: bool = False) -> None:
        nonlocal words
        if words:
            out.append((line, words, definition))
        words = []

    while k < len(toks):
        t = toks[k]
        if t.kind == "op":
            if t.value in _REDIRECTIONS:
                k += 2  # the operator and its target word
                continue
            if t.value == "(" and len(words) == 1 and k + 1 < len(toks) and toks[k + 1].value == ")":
                flush(definition=True)  # name ( ): a function definition
                k += 2
                continue
            flush()
            k += 1
            continue
        nxt = toks[k + 1] if k + 1 < len(toks) else None
        if nxt is not None and nxt.kind == "op" and nxt.value in _REDIRECTIONS and nxt.start == t.end and _IO_NAME.fullmatch(t.value):
            k += 1  # an io number or variable: 2>&1, {fd}>file
            continue
        if skip_until_in:
            skip_until_in = t.value != "in"
            k += 1
            continue
        if not words:
            if not t.quoted and t.value in _RESERVED:
                k += 1
                continue
            if not t.quoted and t.value == "case":
                skip_until_in = True
                k += 1
                continue
            if not t.quoted and t.value == "function" and nxt is not None and nxt.kind == "word":
                out.append((nxt.line, [nxt.value], True))
                k += 2
                continue
            if _ASSIGNMENT.match(t.value) and not t.value.startswith(("'", '"')):
                k += 1
                continue
            line = t.line
        words.append(t.value)
        k += 1
    flush()
    return out


def word_problems(setup: list[str], depth: int = 0) -> list[Problem]:
    """Check 3: command words that end or replace the batch shell, stop it executing, or shadow the launch."""
    text = _text(setup)
    for line, words, definition in commands(text):
        i = _at(setup, line)
        if definition:
            if words[0] in SCRIPT_COMMANDS:
                return [_problem(setup, i, f"defines a function named {words[0]!r}: the batch script calls {words[0]} after "
                                 "the setup, and would run this function instead", "give the function another name")]
            continue
        while words and words[0] in ("builtin", "command") and len(words) > 1:
            words = [w for w in words[1:] if not (words[0] == "command" and w.startswith("-"))] or words[1:]
        name, args = words[0], words[1:]
        if name in ENDS_SCRIPT and not _failing_exit(args):
            return [_problem(setup, i, f"`{name}` in the setup ends the batch script before srun starts any rank (with "
                             "exit 0 the job ends COMPLETED, nothing trained)",
                             "drop it; to fail the job when a setup step fails, exit with a non-zero number "
                             "(`module load x || exit 1`) or put `set -e` first")]
        if name == "exec" and args:
            return [_problem(setup, i, "`exec` with a command replaces the batch shell: the srun line after the setup "
                             "never runs", "run the command without exec (`exec >FILE 2>&1`, redirections only, is fine)")]
        if name == "kill" and any(a in ("$$", "${$}", "$BASHPID", "${BASHPID}", "0") for a in args):
            return [_problem(setup, i, "kills the batch shell itself: the srun line after the setup never runs",
                             "drop it; to fail the job when a setup step fails, put `set -e` first")]
        if name == "shopt" and "noexec" in args and "-o" in "".join(a for a in args if a.startswith("-")) and \
                "s" in "".join(a for a in args if a.startswith("-")):
            args = ["-n"]
            name = "set"
        if name == "set" and _noexec(args):
            return [_problem(setup, i, "`set -n` (noexec) makes bash read every later line without running it: the "
                             "srun line never runs and the job ends COMPLETED", "drop the n option")]
        if name == "alias" and any(a.split("=", 1)[0] in SCRIPT_COMMANDS for a in args if "=" in a):
            return [_problem(setup, i, "an alias named after a command the batch script runs after the setup",
                             "give the alias another name")]
        if name == "eval" and args and depth < 4:
            inner = word_problems([" ".join(args)], depth + 1)
            if inner:
                return [_problem(setup, i, f"eval runs: {inner[0].what}", inner[0].hint)]
    return []


def _failing_exit(args: list[str]) -> bool:
    """``exit N`` with a literal N in 1..255: the job ends FAILED, as a guard like ``module load x || exit 1`` means."""
    return len(args) == 1 and args[0].isdigit() and 0 < int(args[0]) < 256


def _noexec(args: list[str]) -> bool:
    """``set`` arguments that turn on noexec: ``-n``, ``-xn``, ``-o noexec``, ``-eo noexec``."""
    j = 0
    while j < len(args):
        a = args[j]
        if a in ("--", "-") or a[:1] not in ("-", "+"):
            return False
        flags, on = a[1:], a[0] == "-"
        for pos, ch in enumerate(flags):
            if ch == "o":
                name = flags[pos + 1:] or (args[j + 1] if j + 1 < len(args) else "")
                if on and name == "noexec":
                    return True
                j += 0 if flags[pos + 1:] else 1
                break
            if ch == "n" and on:
                return True
        j += 1
    return False


def setup_problems(setup: list[str]) -> list[Problem]:
    """Every check of the setup lines (1-3 above): [] when the batch script reaches its srun line through them."""
    problems = parse_problems(setup)
    if problems:
        return problems
    try:
        return word_problems(setup)
    except RecursionError:
        return [_problem(setup, len(setup) - 1, "the setup nests $( ), quotes or braces too deeply to check",
                         "a setup line nests a few levels; move deep logic into a script the setup sources")]


def script_problems(script: str, where: str = "slurm") -> list[Problem]:
    """The whole rendered script through ``bash -n`` (after ``setup_problems`` passed, a failure is ours)."""
    verdict = bash_n(script)
    if verdict.clean:
        return []
    line, message = verdict.first()
    lines = script.splitlines()
    shown = lines[line - 1] if line and 0 < line <= len(lines) else ""
    return [Problem(where, f"the rendered batch script does not parse (bash -n): {message}",
                    f"line {line}: {shown[:160]!r}" if line else message,
                    "a value in the spec breaks the script: check slurm.python, [env] and [container]; "
                    "`swiftslurm render SPEC` shows the script")]
