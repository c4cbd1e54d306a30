"""shell_quote: every value arrives in bash literally (checked by a real bash, not by string compares)."""

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftslurm.quoting import one_line, shell_quote

NASTY = [
    "'; touch /tmp/pwned #",
    "$(touch /tmp/pwned)",
    "`touch /tmp/pwned`",
    "a b  c",
    "line1\nline2",
    "",
    "'",
    '"',
    "\\",
    "*",
    "~root",
    "!!",
    "${HOME}",
    "-n",
    "a\tb\r",
    "ünïcødé",
]


def bash_echo(words: list[str]) -> list[str]:
    """What bash receives when each quoted word is placed in a command line."""
    script = "for a in " + " ".join(shell_quote(w) for w in words) + "; do printf '%s\\0' \"$a\"; done"
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    return out.decode("utf-8", "surrogateescape").split("\0")[:-1]


def test_nasty_values_arrive_literally(tmp_path):
    pwned = tmp_path / "pwned"
    words = [w.replace("/tmp/pwned", str(pwned)) for w in NASTY]
    assert bash_echo(words) == words
    assert not pwned.exists()


def test_plain_words_stay_bare():
    assert shell_quote("node1") == "node1"
    assert shell_quote("/a/b-c_d.json") == "/a/b-c_d.json"
    assert shell_quote(42) == "42"
    assert shell_quote("a b") == "'a b'"


def test_nul_is_refused():
    with pytest.raises(ValueError, match="NUL"):
        shell_quote("a\x00b")


def test_one_line_refuses_line_breaks():
    assert one_line("x y", "v") == "x y"
    for bad in ("a\nb", "a\rb", "a\x00b"):
        with pytest.raises(ValueError, match="one line"):
            one_line(bad, "#SBATCH --comment")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20), min_size=1, max_size=5))
def test_any_text_roundtrips_through_bash(words):
    assert bash_echo(words) == words
