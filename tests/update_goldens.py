"""Write the golden files the tests compare against: `python -m tests.update_goldens [--check]` from the repo root.

The tests only compare (a test that rewrote its golden before comparing would follow the code); when a change to
a rendered script or a merged DeepSpeed preset is meant, run this and review the diff of tests/golden/ in the
commit. Each golden is made by the function its test compares with: test_dsconfig.preset_golden,
test_siteenv.container_golden. --check writes nothing and exits 1 when a golden differs from what the code makes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def goldens() -> Iterator[tuple[Path, str]]:
    """(golden file, the text the code makes now), for every golden the tests compare."""
    sys.path.insert(0, str(TESTS))  # the test modules import each other and conftest as top-level modules
    import test_dsconfig
    import test_siteenv

    for name in test_dsconfig.PRESETS:
        yield test_dsconfig.preset_golden(name)
    for name in test_siteenv.CONTAINER_GOLDENS:
        yield test_siteenv.container_golden(name)


def main(argv: list[str]) -> int:
    check = "--check" in argv[1:]
    changed = []
    for path, text in goldens():
        if path.is_file() and path.read_text() == text:
            continue
        changed.append(path)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in changed:
        print(f"{'differs' if check else 'wrote'}: {path.relative_to(TESTS.parent)}")
    if not changed:
        print("every golden matches the code")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
