"""Test hook, on PYTHONPATH only where a test puts it (conftest.exit_threads_env): with
$SWIFTSLURM_TEST_EXIT_THREADS = DIR, a Python process that has a rank ($RANK, $SLURM_PROCID or
$SUBMITIT_LOCAL_GLOBALID) records, at interpreter exit (atexit, the
last handler to run, before finalization), the OS names of all its threads in DIR/rank<RANK>-<pid>.json.

A C++ thread of a process group still running there can abort the rank during finalization (issue 21, 15b).
"""

import atexit
import json
import os

_DIR = os.environ.get("SWIFTSLURM_TEST_EXIT_THREADS")
_RANK = next((os.environ[k] for k in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID") if os.environ.get(k)), None)


def _record() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append((int(tid) == os.getpid(), f.read().strip()))
        except OSError:
            pass
    main = next((name for is_main, name in names if is_main), "")
    others = sorted(name for is_main, name in names if not is_main)
    path = os.path.join(_DIR, f"rank{_RANK}-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"main": main, "threads": others}, f)


if _DIR and _RANK is not None:
    atexit.register(_record)  # registered first, so it runs last
