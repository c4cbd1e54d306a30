"""Shared test setup: the `slurm` marker and the local Slurm cluster (tests/cluster/up.sh).

A test marked `@pytest.mark.slurm` needs the cluster. When `sinfo` does not answer, it is
skipped with the reason, except under CI=true, where a missing cluster is a failure.
Helpers for such tests: the `slurm_cluster` fixture (node names) and
`from conftest import wait_for_job, sacct_rows`.

Under CI=true nothing skips but a test that needs hardware CI cannot have (GPUs): such a test
skips through `needs_hardware(what, have)`, whose reason starts with HARDWARE_SKIP and names the
hardware. Every other skip, wherever it comes from (a skipif mark, pytest.skip() in a test or
fixture, importorskip in a test or at module level, a whole module skipped at collection), is
turned into a failure here (`_deny_skip`); `.ci/run` checks pytest's JUnit report for the same.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from functools import lru_cache

import pytest

from swiftslurm import slurm

HARDWARE_SKIP = "needs hardware CI does not have: "
START_HINT = "bring it up with tests/cluster/up.sh as root (see tests/cluster/README.md)"

# sacct states after which a job will not change again (a requeued job shows REQUEUED, then PENDING): the one list
FINAL_STATES = slurm.FINAL_STATES


def pytest_configure(config: pytest.Config) -> None:
    # One ninja for DeepSpeed's JIT op builds (the CPU shm comm op): the venv's first on PATH, for the
    # tests and the Slurm jobs they submit (sbatch exports the environment). A system ninja of another
    # version rewrites the build log in its own format, so each switch rebuilds the op, and a rank that
    # loads it during a rebuild reads a half-written .so ("file too short").
    bindir = os.path.dirname(sys.executable)
    if not os.environ.get("PATH", "").startswith(bindir + os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # One DeepSpeed JIT build cache per venv: torch keys a build by its source and include paths, so two
    # venvs (two checkouts) sharing ~/.cache/torch_extensions rebuild the op on every switch, and a test that
    # kills a rank mid-build leaves a lock file every later build waits on. `make ds-ops` builds it here.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if os.environ.get("CI") == "true":
        # a module whose skip _deny_skip fails is one collection error; the rest of the suite still runs
        config.option.continue_on_collection_errors = True
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster of tests/cluster/up.sh")
    config.addinivalue_line("markers", "slow: takes tens of seconds or more")
    config.addinivalue_line("markers", "alone: runs with no other test beside it (parallel workers: see _machine_share)")


# The suite runs in parallel workers (pytest-xdist, `make test`), a file to a worker, so the waiting of the Slurm
# tests (the queue, walltime signals, hang limits) overlaps the CPU-bound tests. Files start slowest first (the
# per-file times of tests/DURATIONS.txt, the last CI rehearsal), so no long file starts last. A test that must
# have the machine to itself (it sets a cluster node down, which kills every job on it; it reconfigures slurmctld,
# which holds the jobs being launched; or it times the machine)
# is marked `alone`: it takes the machine lock exclusively, every other test takes it shared.
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "DURATIONS.txt")


def _file_seconds() -> dict[str, float]:
    """test file stem -> its seconds in the last CI rehearsal (tests/DURATIONS.txt's per-file table)."""
    try:
        text = open(DURATIONS, encoding="utf-8").read()
    except OSError:
        return {}
    return {name: float(s) for s, name in re.findall(r"(?m)^\s+([\d.]+) s  (test_\w+)$", text)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if "slurm_cluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slurm")]
    if unmarked:  # `-m "not slurm"` (the fast tier) must leave out every test that needs the cluster
        raise pytest.UsageError("tests that use the slurm_cluster fixture without @pytest.mark.slurm: " + ", ".join(unmarked))
    seconds = _file_seconds()
    # a stable sort: the tests of a file stay together and in their order (module fixtures are made once)
    items.sort(key=lambda item: -seconds.get(item.path.stem, 0.0))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _machine_share(item.config, exclusive=item.get_closest_marker("alone") is not None):
        return (yield)


@contextlib.contextmanager
def _machine_share(config: pytest.Config, *, exclusive: bool):
    """Hold the machine shared (most tests) or exclusively (`alone`) across the test's setup, call and teardown.

    A readers-writer lock of two flock files in the run's common temp dir: the turnstile is passed by every test
    on its way in and held by an exclusive one until it has the machine, so a stream of shared tests cannot starve
    it. Without workers (one process) there is nothing to share and nothing is locked.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl

    base = config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]  # the workers' common dir
    with open(base / "machine.turnstile", "a") as turnstile, open(base / "machine.lock", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


def needs_hardware(what: str, have: bool) -> pytest.MarkDecorator:
    """Skip unless `have`, naming the hardware (e.g. "2 CUDA GPUs"): the one skip CI=true allows."""
    return pytest.mark.skipif(not have, reason=HARDWARE_SKIP + what)


def skip_allowed_in_ci(reason: str) -> bool:
    """Whether a skip with this reason may stand under CI=true (also used by .ci/skips.py on the JUnit report)."""
    return reason.removeprefix("Skipped: ").startswith(HARDWARE_SKIP)


def _deny_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under CI=true, a skip that does not name missing hardware becomes a failure carrying its reason."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if skip_allowed_in_ci(reason):
        return
    where = f"{longrepr[0]}:{longrepr[1]}: " if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""
    report.outcome = "failed"
    report.longrepr = (f"CI=true: only a test that needs hardware CI cannot have may skip (reason starting "
                       f"{HARDWARE_SKIP!r}); this one skipped at {where}{reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    _deny_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield  # a module-level importorskip or pytest.skip(allow_module_level=True) skips the whole module here
    _deny_skip(report)
    return report


def _natural(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


@lru_cache(maxsize=1)
def _probe_cluster() -> tuple[tuple[str, ...], str]:
    """(node names, "") when sinfo answers with nodes, else ((), why not)."""
    if shutil.which("sinfo") is None:
        return (), "sinfo is not installed"
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return (), "sinfo did not answer within 20 s"
    if proc.returncode != 0:
        return (), f"sinfo exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    nodes = sorted(set(proc.stdout.split()), key=_natural)
    if not nodes:
        return (), "sinfo lists no nodes"
    return tuple(nodes), ""


def _require_cluster() -> tuple[str, ...]:
    nodes, why = _probe_cluster()
    if nodes:
        return nodes
    message = f"the local Slurm cluster is not up ({why}); {START_HINT}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slurm") is not None:
        _require_cluster()


@pytest.fixture(scope="session")
def slurm_cluster() -> tuple[str, ...]:
    """The cluster's node names, in order: ("node1", ..., "nodeN")."""
    return _require_cluster()


@pytest.fixture(scope="session")
def node_addresses(slurm_cluster) -> tuple[str, ...]:
    """The node names, each resolving to its own loopback address (tests/cluster/up.sh writes them to /etc/hosts)."""
    import socket

    for i, node in enumerate(slurm_cluster, start=1):
        try:
            address = socket.gethostbyname(node)
        except OSError as exc:
            address = f"no address ({exc})"
        assert address == f"127.0.0.{i}", f"{node} resolves to {address}, not 127.0.0.{i}: tests/cluster/up.sh adds node1..nodeN to /etc/hosts"
    return slurm_cluster


def sacct_rows(job_id: str, *fields: str, runs: bool = False, timeout_s: float = 30) -> list[list[str]]:
    """``sacct -X [-D] -j JOB`` rows of the job itself (or its array tasks): per row, the ``fields``.

    ``sacct -j 4947`` also lists a task of another array whose raw id is 4947 (``4928_0``): a split-off array task
    takes the next free id, and Slurm hands an id out again once it forgot the job (the test cluster's MinJobAge is
    10 s). Such a row is not this job: it is dropped by its JobID (``slurm.is_of``), as the product's door does.
    ``runs``: every run of a requeued job (``-D``: earlier ones say REQUEUED). Raises on a sacct error.
    """
    argv = ["sacct", "-X", "-n", "-P", *(["-D"] if runs else []), "-j", str(job_id), "-o", ",".join(("JobID", *fields))]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True)
    rows = [line.split("|", len(fields)) for line in proc.stdout.splitlines() if line.strip()]
    return [row[1:] for row in rows if len(row) == len(fields) + 1 and slurm.is_of(row[0], str(job_id))]


def wait_for_job(job_id: str, timeout_s: float, *, min_rows: int = 1, poll_s: float = 0.5) -> dict[str, str]:
    """Poll sacct until the job (every array task) is in a final state; return {JobID: State}.

    min_rows: how many rows must be there (an array of 4 tasks: 4), since sacct learns of a job
    a moment after sbatch returns. Raises TimeoutError with the last rows seen. Rows of another job under the same
    raw id are not counted (``sacct_rows``): the straggler test once took an earlier array's finished task for its job.
    """
    deadline = time.monotonic() + timeout_s
    rows: dict[str, str] = {}
    while True:
        try:
            proc = subprocess.run(
                ["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "JobID,State"],
                capture_output=True,
                text=True,
                timeout=max(1.0, min(30.0, deadline - time.monotonic())),
            )
        except subprocess.TimeoutExpired:
            proc = None
        if proc is not None and proc.returncode == 0:
            # "CANCELLED by 0" -> "CANCELLED"
            rows = {jid: (state.split() or [""])[0] for jid, _, state in (line.partition("|") for line in proc.stdout.splitlines() if line.strip())
                    if slurm.is_of(jid, str(job_id))}
            if len(rows) >= min_rows and all(state in FINAL_STATES for state in rows.values()):
                return rows
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Slurm job {job_id} not finished after {timeout_s} s; last sacct rows: {rows}")
        time.sleep(poll_s)


EXIT_THREADS_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_threads")


def exit_threads_env(record_dir) -> dict[str, str]:
    """Env for ranks that record their threads at exit into record_dir (tests/exit_threads/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (EXIT_THREADS_HOOK, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "SWIFTSLURM_TEST_EXIT_THREADS": str(record_dir)}


# Threads that may run at exit without harm: jemalloc's background purger, started by pyarrow's allocator (the
# dataset readers use pyarrow), only touches its own arenas and is not joined at finalization.
BENIGN_EXIT_THREADS = frozenset({"jemalloc_bg_thd"})


def threads_at_exit(record_dir) -> dict[int, list[str]]:
    """rank -> names of the threads still running when that rank exited, less those that carry the main thread's
    name (Python's own and OpenMP's: torch.distributed's C++ threads name themselves, e.g. pt_gloo_runloop) and
    the BENIGN_EXIT_THREADS."""
    import json
    from pathlib import Path

    found: dict[int, list[str]] = {}
    for path in sorted(Path(record_dir).glob("rank*-*.json")):
        record = json.loads(path.read_text())
        rank = int(path.name[4:].split("-")[0])
        found[rank] = [name for name in record["threads"] if name != record["main"] and name not in BENIGN_EXIT_THREADS]
    return found


@pytest.fixture(autouse=True)
def _own_ledger(tmp_path_factory, monkeypatch):
    """Every test gets its own node-health ledger (a preflight failure or a doctor run records nodes there): the
    user's ~/.swiftslurm/ledger.json would make later submits on the shared cluster avoid the nodes a test blamed."""
    monkeypatch.setenv("SWIFTSLURM_LEDGER", str(tmp_path_factory.mktemp("ledger") / "ledger.json"))
    # and its own job index (jobs/index.py: every Slurm submit appends to it), never the user's
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


OTHER_UID = 65534  # nobody


def run_as_another_user(args: list[str], *, cwd: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m swiftslurm ARGS`` as uid 65534 (nobody), with its Python, this venv's packages and this checkout
    reachable wherever the clone lies: each is bind-mounted onto a fresh 0755 directory inside a private mount
    namespace. Run straight from a clone under root's own 0700 home, nobody reached none of them ("No module named
    swiftslurm"). Needs root (CI's user), as dropping to another user does anyway."""
    import sysconfig
    import tempfile

    base = os.path.realpath(sys.base_prefix)  # the interpreter's installation: its binary, stdlib and libpython
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    src = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    python = os.path.relpath(os.path.realpath(sys.executable), base)
    mnt = tempfile.mkdtemp(prefix="swiftslurm-as-nobody-", dir="/tmp")
    try:
        os.chmod(mnt, 0o755)
        for name in ("base", "site", "src"):
            os.mkdir(os.path.join(mnt, name), 0o755)
        binds = 'mount --bind "$1" "$2/base" && mount --bind "$3" "$2/site" && mount --bind "$4" "$2/src" && shift 4 && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", binds, "sh", base, mnt, site, src,
                "setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                os.path.join(mnt, "base", python), "-m", "swiftslurm", *args]
        env = {**env, "PYTHONPATH": f"{mnt}/src{os.pathsep}{mnt}/site", "PYTHONNOUSERSITE": "1",
               "LD_LIBRARY_PATH": os.path.join(mnt, "base", "lib")}
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)
    finally:
        os.rmdir(os.path.join(mnt, "base")), os.rmdir(os.path.join(mnt, "site")), os.rmdir(os.path.join(mnt, "src")), os.rmdir(mnt)
