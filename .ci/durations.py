"""Where the suite's time goes: every test's duration from pytest's JUnit report, slowest first, with the total per
file and per marker, into a plain text file anyone changing the suite reads before adding a slow test.

Usage: python .ci/durations.py REPORT.xml OUT.txt (``.ci/run`` writes ``.ci/durations.txt`` after every run; the
copy committed as ``tests/DURATIONS.txt`` is the last rehearsal of CI on 2 cores, named at its top).
"""

from __future__ import annotations

import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def table(report: Path) -> str:
    cases = [(float(c.get("time", 0) or 0), f"{c.get('classname', '')}::{c.get('name', '')}") for c in ET.parse(report).getroot().iter("testcase")]
    cases.sort(reverse=True)
    per_file: dict[str, float] = defaultdict(float)
    for seconds, test in cases:
        per_file[test.split("::")[0].rsplit(".", 1)[-1]] += seconds
    total = sum(s for s, _ in cases)
    lines = [f"# {len(cases)} tests, {total / 60:.1f} min of test time, written {time.strftime('%Y-%m-%d %H:%M')}", "",
             "## per file, slowest first"]
    lines += [f"{s:8.1f} s  {name}" for name, s in sorted(per_file.items(), key=lambda x: -x[1])]
    lines += ["", "## per test, slowest first (those over 1 s)"]
    lines += [f"{s:8.1f} s  {test}" for s, test in cases if s >= 1.0]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report, out = Path(sys.argv[1]), Path(sys.argv[2])
    if report.is_file() and report.stat().st_size:
        out.write_text(table(report))
        print(f"per-test durations: {out}")
