"""Fail when pytest's JUnit report holds a skip that does not name missing hardware.

Usage: python .ci/skips.py REPORT.xml. The rule is tests/conftest.py's `skip_allowed_in_ci` (under CI=true
the conftest already turns such a skip into a failure; this is the second lock, for a run that bypassed
the conftest). Prints each skip; exit 1 when one is not allowed or the report is missing or empty.
"""

from __future__ import annotations

import ast
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import skip_allowed_in_ci  # noqa: E402


def skips(report: Path) -> list[tuple[str, str]]:
    """(test id, reason) of every skipped test or module in a JUnit report."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for skipped in case.iter("skipped"):
            reason = skipped.get("message", "")
            if skipped.get("message") == "collection skipped":  # a module skipped at collection: the reason is the text
                text = (skipped.text or "").strip()  # "(path, line, 'Skipped: why')"
                try:
                    reason = str(ast.literal_eval(text)[2])
                except (ValueError, SyntaxError, IndexError, TypeError):
                    reason = text
            found.append((f"{case.get('classname')}::{case.get('name')}", reason))
    return found


def main(argv: list[str]) -> int:
    report = Path(argv[1])
    if not report.is_file() or not any(ET.parse(report).getroot().iter("testcase")):
        print(f"ci: no test results in {report}", file=sys.stderr)
        return 1
    bad = 0
    for test, reason in skips(report):
        allowed = skip_allowed_in_ci(reason)
        bad += not allowed
        print(f"ci: {'skipped (hardware)' if allowed else 'SKIPPED, NOT ALLOWED IN CI'}: {test}: {reason}", file=sys.stderr)
    if bad:
        print(f"ci: {bad} test(s) skipped for a reason other than missing hardware; CI runs every test", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
