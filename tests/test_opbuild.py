"""DeepSpeed's op builds never stall a rank: a build killed midway leaves torch's bare `lock` file behind, and the
next build takes it over (train/kernels/opbuild.py); a start that waits anyway is ended by the start-up watch with the lock
named (train/health/startup.py), and doctor says so.

The kill is real: a builder of the CPU comm op (about 30 s of gcc here) is SIGKILLed with its ninja and compilers
once torch's lock exists, then a whole local run starts on that cache and must train (the finished op's files copied in
beside the dead build's lock, so that the run's build is ninja finding them up to date: the lock is what is tested)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swiftslurm import fsutil
from swiftslurm.train.health import startup
from swiftslurm.train.kernels import opbuild

ROOT = Path(__file__).resolve().parents[1]
OP, OP_DIR = "ShareMemCommBuilder", "deepspeed_shm_comm"

BUILD = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from swiftslurm.train.kernels import opbuild
from swiftslurm.train.health import startup
from deepspeed.accelerator import get_accelerator  # imported before the watch: its limit times the wait, not imports
get_accelerator()
def expired(what):
    print("EXPIRED:", what, flush=True)
with startup.watching(float(sys.argv[3]), expired):
    opbuild.ensure_built((sys.argv[1],), os.environ["TORCH_EXTENSIONS_DIR"], sys.argv[2] == "ours", sys.argv[4], startup.mark)
print("BUILT", flush=True)
"""


def _env(ext: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and everything it started, as Slurm ends a killed step (its cgroup): ninja runs each compiler
    in a process group of its own, so killing the builder's group alone left two gcc processes compiling on, orphaned,
    for half a minute of CPU each while the rest of the suite ran."""
    import psutil

    tree = [proc.pid] + [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _kill_inside_build(ext: Path) -> None:
    """Start a build of the comm op and SIGKILL it (its whole process group) once torch's lock is there."""
    # "localhost": the node name a rank of the local executor has, so that the run below is on the dead build's host
    proc = subprocess.Popen([sys.executable, "-c", BUILD, OP, "user", "600", "localhost"], env=_env(ext), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = ext / OP_DIR / opbuild.TORCH_LOCK
    deadline = time.monotonic() + 120
    while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.exists(), "the builder never started building"
    time.sleep(2)  # the compilers are at work
    kill_tree(proc)
    assert lock.exists(), "the killed build left no lock: nothing to take over"
    holder = opbuild.Holder.parse((ext / opbuild.BUILD_LOCK).read_bytes())
    assert holder is not None and holder.pid == proc.pid and holder.ops == (OP,)


def test_needed_ops_follow_the_device_and_the_offload():
    zero = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}}
    assert opbuild.needed_ops({}, cuda=False) == ("ShareMemCommBuilder",)
    assert opbuild.needed_ops({}, cuda=True) == ()
    assert opbuild.needed_ops(zero, cuda=True) == ("CPUAdamBuilder",)
    assert opbuild.needed_ops(nvme, cuda=True) == ("CPUAdamBuilder", "AsyncIOBuilder")


def test_our_cache_is_per_node_and_per_environment():
    a = opbuild.default_cache("/h/.cache", "node1", "311", "2.13.0+cpu", "/venv/a")
    assert a.startswith("/h/.cache/swiftslurm/torch_extensions/node1/py311-torch2.13.0+cpu-")
    assert a != opbuild.default_cache("/h/.cache", "node2", "311", "2.13.0+cpu", "/venv/a")
    assert a != opbuild.default_cache("/h/.cache", "node1", "311", "2.13.0+cpu", "/venv/b")
    assert "/../" not in opbuild.default_cache("/h", "../x", "311", "t", "/v")
    assert opbuild.cache_dir({"TORCH_EXTENSIONS_DIR": "/mine"}, "node1") == ("/mine", False)
    root, ours = opbuild.cache_dir({"XDG_CACHE_HOME": "/xdg", "HOME": "/home/u"}, "node1")
    assert ours and root.startswith("/xdg/swiftslurm/torch_extensions/node1/")


def test_a_lock_is_taken_over_only_when_a_dead_build_of_ours_explains_it(tmp_path):
    (tmp_path / OP_DIR).mkdir()
    (tmp_path / OP_DIR / "lock").touch()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = opbuild.Holder("thishost", int(dead.stdout), time.time(), (OP,))
    assert opbuild.stale_locks(tmp_path, (OP,), None, True, "thishost")[0] == [tmp_path / OP_DIR / "lock"]  # our cache
    assert opbuild.stale_locks(tmp_path, (OP,), gone, False, "thishost")[0] == [tmp_path / OP_DIR / "lock"]
    here = opbuild.this_machine()
    reused = opbuild.Holder("thishost", os.getpid(), 0.0, (OP,), here, fsutil.process_start(os.getpid()) + 1)
    assert opbuild.stale_locks(tmp_path, (OP,), reused, False, "thishost")[0] == [tmp_path / OP_DIR / "lock"]  # pid reused
    aliased = opbuild.Holder("node2", int(dead.stdout), 0.0, (OP,), here)  # another node name, the same machine
    assert opbuild.stale_locks(tmp_path, (OP,), aliased, False, "node1")[0] == [tmp_path / OP_DIR / "lock"]
    live = opbuild.Holder("thishost", os.getpid(), 0.0, (OP,), here, fsutil.process_start(os.getpid()))
    elsewhere = opbuild.Holder("node2", 1, 0.0, (OP,), "another-boot-id")
    for previous in (None, live, elsewhere):
        remove, judge = opbuild.stale_locks(tmp_path, (OP,), previous, False, "thishost")
        assert remove == [] and str(tmp_path / OP_DIR / "lock") in judge[0]
    assert opbuild.Holder.parse(b"") is None and opbuild.Holder.parse(b"\x00garbage") is None


def test_a_foreign_lock_ends_the_start_with_the_lock_named(tmp_path):
    """A torch lock in the user's cache that no build of ours left: the wait is bounded and says what it waits on."""
    ext = tmp_path / "ext"
    (ext / OP_DIR).mkdir(parents=True)
    (ext / OP_DIR / "lock").touch()
    proc = subprocess.run([sys.executable, "-c", BUILD, OP, "user", "8", "thishost"], env=_env(ext), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == startup.STARTUP_HANG_EXIT, proc.stdout + proc.stderr
    said = next(line for line in proc.stdout.splitlines() if line.startswith("EXPIRED:"))
    assert startup.STUCK in said and str(ext / OP_DIR / "lock") in said and "delete it" in said
    assert "File " in proc.stderr and "BUILT" not in proc.stdout  # every thread's stack, and no training
    assert (ext / OP_DIR / "lock").exists()  # not ours: left where it was


def _finish_as_built_elsewhere(ext: Path) -> None:
    """Copy the finished op (built once in this machine's own op cache, where every other run's ranks build it) in
    beside the dead build's lock: the run's build then finds its outputs up to date instead of spending half a minute
    of gcc on what this test does not look at. The lock and the build lock are left as the killed build left them."""
    root, _ = opbuild.cache_dir(os.environ, "localhost")
    env = {**_env(Path(root)), "TORCH_EXTENSIONS_DIR": root}
    subprocess.run([sys.executable, "-c", BUILD, OP, "ours", "600", "localhost"], env=env, check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for built in (Path(root) / OP_DIR).iterdir():
        if built.is_file() and built.name != opbuild.TORCH_LOCK:
            shutil.copy2(built, ext / OP_DIR / built.name)


@pytest.mark.slow
def test_a_run_after_a_build_killed_midway_trains(tmp_path):
    ext = tmp_path / "ext"
    _kill_inside_build(ext)
    _finish_as_built_elsewhere(ext)
    out = tmp_path / "run"
    spec = tmp_path / "job.toml"
    text = (ROOT / "examples" / "quickstart.toml").read_text()
    text = text.replace('output_dir = "output/quickstart"', f'output_dir = "{out}"').replace('"examples/data/', f'"{ROOT}/examples/data/')
    text = text.replace("max_steps = 50", "max_steps = 4").replace("save_steps = 25", "save_steps = 4")
    text = text.replace('checks = ["ports", "allreduce", "disk"]', "checks = []")
    spec.write_text(text)
    env = {**_env(ext), "SWIFTSLURM_STARTUP_LIMIT_S": "600"}
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", str(spec), "--executor", "local", "--wait"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").rglob("*") if p.is_file() and p.suffix != ".pkl")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs[-4000:]
    assert "left by a build that died" in proc.stdout + proc.stderr + logs
    assert logs.count("swiftslurm attempt ") == 2  # each rank's log opens with its attempt (logs --attempt N)
    assert not (ext / OP_DIR / "lock").exists()
    assert opbuild.Holder.parse((ext / opbuild.BUILD_LOCK).read_bytes()) is None  # the last build finished
    assert (out / "checkpoint-4").is_dir()


def test_an_op_cache_that_cannot_be_made_leaves_the_ops_to_deepspeed(tmp_path, monkeypatch):
    """A read-only home or a file in the cache's place: a warning, never a rank that dies before DeepSpeed could try."""
    (tmp_path / "file").write_text("")
    root = str(tmp_path / "file" / "cache")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", root)
    opbuild.ensure_built((OP,), root, True, "thishost")
    assert not (tmp_path / "file" / "cache").exists()



def test_the_start_up_limit_is_the_collective_timeout_and_never_under_half_an_hour(monkeypatch):
    monkeypatch.delenv(startup.LIMIT_ENV, raising=False)
    assert startup.limit_s(None) == 1800 and startup.limit_s(60) == 1800 and startup.limit_s(7200) == 7200
    monkeypatch.setenv(startup.LIMIT_ENV, "5")
    assert startup.limit_s(7200) == 5
