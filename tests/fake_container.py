"""Stateful fakes of the two container runtimes (neither can run here): they enforce what they mount.

``apptainer exec`` and pyxis' ``srun --container-*`` both start the command inside a private root made of
bind mounts, in its own mount namespace (``unshare --mount``; the tests run as root):

- the *image* is a file (``*.sif`` / ``*.sqsh``) holding ``{"fake_image": [host paths]}``: those paths
  (read-only) are what the image contains. ``make_image`` writes one with the OS, this interpreter and
  the source checkout (the image has swiftslurm installed);
- each bind ``SRC:DST[:ro|rw]`` shows host SRC at DST; ``/proc``, ``/sys``, ``/dev`` are the host's and
  ``/tmp`` is a fresh tmpfs (as ``apptainer --contain``, and as a site with ``mount tmp = no``);
- nothing else of the host is visible: a path the job needs and we forgot to bind is missing inside,
  as it would be on a real cluster;
- ``--pwd`` / ``--container-workdir`` must exist inside; each start appends one JSON line (argv, rank,
  node, binds) to a state file.

The writable flags (``--writable-tmpfs``, ``--container-writable``) are accepted and recorded, but the
image stays read-only: its paths are the host's own.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENTER = r'''#!__PYTHON__
"""Start a command inside a private root of bind mounts (see tests/fake_container.py)."""
import fcntl, json, os, subprocess, sys

STATE = __STATE__
NEWROOT = "/tmp/.fake-container-root"  # a mount point only: each start mounts its own tmpfs there, in its own namespace


def fatal(msg):
    sys.exit(f"FATAL: {msg}")


def parse(argv):
    opts = {"image": None, "binds": [], "pwd": None, "runtime": None}
    i = 0
    while i < len(argv) and argv[i] != "--":
        key, value = argv[i], argv[i + 1]
        (opts["binds"].append(value) if key == "--bind" else opts.__setitem__(key[2:], value))
        i += 2
    return opts, argv[i + 1:]


def mount(*args):
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        fatal(f"mount {' '.join(args)}: {proc.stderr.strip()}")


def place(dst, is_dir, mounted):
    """Create the mount point ``dst`` inside the new root: only on its own tmpfs, never inside a host path."""
    target = NEWROOT + dst
    if os.path.lexists(target):
        return target
    missing = dst
    while not os.path.lexists(NEWROOT + os.path.dirname(missing)):
        missing = os.path.dirname(missing)
    parent = os.path.dirname(missing)
    for m in mounted:
        if parent == m or parent.startswith(m.rstrip("/") + "/"):
            fatal(f"mount point {dst} does not exist in the container (inside {m})")
    if is_dir:
        os.makedirs(target)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    return target


def bind(src, dst, ro, mounted):
    target = place(dst, os.path.isdir(src), mounted)
    mount("--rbind", src, target)
    if ro:
        mount("-o", "remount,bind,ro", target)
    mounted.append(dst)


def main():
    opts, command = parse(sys.argv[1:])
    if os.environ.get("FAKE_CONTAINER_NS") != "1":  # first: into a private mount namespace
        os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv],
                   {**os.environ, "FAKE_CONTAINER_NS": "1"})
    image = opts["image"]
    try:
        with open(image) as fh:
            content = json.load(fh)["fake_image"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fatal(f"could not open image {image}: {exc}")
    binds = []
    for b in opts["binds"]:
        parts = b.split(":")
        src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
        flags = parts[2] if len(parts) > 2 else "rw"
        if not os.path.isabs(src) or not os.path.isabs(dst) or flags not in ("ro", "rw") or len(parts) > 3:
            fatal(f"bad mount {b!r}: SRC:DST[:ro|rw] with absolute paths")
        if not os.path.exists(src):
            fatal(f"mount source {src} does not exist")
        binds.append((os.path.normpath(src), os.path.normpath(dst), flags == "ro"))
    os.makedirs(NEWROOT, exist_ok=True)
    mount("-t", "tmpfs", "fakeroot", NEWROOT)
    mounted = []
    # the container's own /tmp first: an image path under the host's /tmp (a checkout or venv there, as in a CI clone)
    # is then bound inside it instead of being hidden by it
    os.makedirs(NEWROOT + "/tmp", exist_ok=True)
    mount("-t", "tmpfs", "tmp", NEWROOT + "/tmp")  # mount points may be made in it
    for path in sorted(content, key=len):  # the image: symlinks as they are (/bin -> usr/bin), everything else read-only
        if os.path.islink(path) and os.path.dirname(path) == "/":
            os.symlink(os.readlink(path), NEWROOT + path)
        elif os.path.exists(path):
            bind(path, path, True, mounted)
    for path in ("/proc", "/sys", "/dev"):
        bind(path, path, False, mounted)
    for src, dst, ro in binds:
        bind(src, dst, ro, mounted)
    with open(STATE, "a") as fh:  # one JSON line per start, under a lock (ranks start at once)
        fcntl.lockf(fh, fcntl.LOCK_EX)
        fh.write(json.dumps({"runtime": opts["runtime"], "argv": json.loads(os.environ.get("FAKE_CONTAINER_ARGV", "[]")),
                             "binds": opts["binds"], "command": command, "rank": os.environ.get("SLURM_PROCID"),
                             "node": os.environ.get("SLURMD_NODENAME")}) + "\n")
    cwd = os.getcwd()
    os.chroot(NEWROOT)
    pwd = opts["pwd"]
    try:
        os.chdir(pwd or cwd)
    except OSError:
        if pwd:
            fatal(f"working directory {pwd} does not exist in the container")
        os.chdir("/")
    env = {k: v for k, v in os.environ.items() if k not in ("FAKE_CONTAINER_NS", "FAKE_CONTAINER_ARGV")}
    if opts["runtime"] == "apptainer":
        env = {k: v for k, v in env.items() if not k.startswith("APPTAINERENV_")}
        env.update({k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")})
        env.update(APPTAINER_CONTAINER=image, APPTAINER_NAME=os.path.basename(image))
    else:
        env.update(PYXIS_IMAGE=image)
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        fatal(f"{command[0]}: {exc.strerror} in the container")


main()
'''

APPTAINER = r'''#!__PYTHON__
"""A stand-in for `apptainer exec` (no Apptainer here): parses what real Apptainer takes, then enters."""
import json, os, sys

args = sys.argv[1:]
if not args or args[0] != "exec":
    sys.exit("FATAL: fake apptainer knows only 'exec'")
i, enter = 1, ["--runtime", "apptainer"]
while i < len(args) and args[i].startswith("-"):
    if args[i] in ("--bind", "-B"):
        for b in args[i + 1].split(","):
            enter += ["--bind", b]
        i += 2
    elif args[i] == "--pwd":
        enter += ["--pwd", args[i + 1]]
        i += 2
    elif args[i] in ("--nv", "--writable-tmpfs", "--cleanenv", "--contain"):
        i += 1
    else:
        sys.exit(f"FATAL: unknown option {args[i]}")
if len(args) < i + 2:
    sys.exit("FATAL: apptainer exec IMAGE COMMAND...")
image, inner = args[i], args[i + 1:]
os.environ["FAKE_CONTAINER_ARGV"] = json.dumps(args)
os.execv(__ENTER__, [__ENTER__, *enter, "--image", image, "--", *inner])
'''

SRUN = r'''#!__PYTHON__
"""A stand-in `srun` with pyxis' --container-* options: the real srun starts each task inside the fake container."""
import json, os, sys

REAL_SRUN = __REAL_SRUN__
VALUED = {"-o", "--output", "-e", "--error", "-i", "--input", "-n", "--ntasks", "-N", "--nodes", "-c", "--cpus-per-task",
          "-J", "--job-name", "-p", "--partition", "-t", "--time", "-w", "--nodelist", "-x", "--exclude", "--mpi",
          "--export", "-D", "--chdir", "--gres", "--mem", "--ntasks-per-node", "--gpus-per-node", "-G", "--gpus", "--signal"}
CONTAINER = {"--container-image", "--container-mounts", "--container-workdir", "--container-env", "--container-name"}
args, srun, pyxis, i = sys.argv[1:], [], {}, 0
while i < len(args) and args[i].startswith("-"):
    key, eq, value = args[i].partition("=")
    if key in CONTAINER:
        if not eq:
            i, value = i + 1, args[i + 1]
        pyxis[key] = value
    elif key in ("--container-writable", "--container-readonly", "--container-remap-root", "--no-container-mount-home"):
        pyxis[key] = True
    elif key.startswith("--container-"):
        sys.exit(f"srun: unrecognized option '{key}'")
    else:
        srun.append(args[i])
        if not eq and key in VALUED:
            i += 1
            srun.append(args[i])
    i += 1
command = args[i:]
if not pyxis:
    os.execv(REAL_SRUN, [REAL_SRUN, *args])
if "--container-image" not in pyxis:
    sys.exit("srun: error: pyxis: --container-image is required")
enter = ["--runtime", "pyxis", "--image", pyxis["--container-image"]]
for m in filter(None, pyxis.get("--container-mounts", "").split(",")):
    enter += ["--bind", m]
if "--container-workdir" in pyxis:
    enter += ["--pwd", pyxis["--container-workdir"]]
os.environ["FAKE_CONTAINER_ARGV"] = json.dumps(args)
os.execv(REAL_SRUN, [REAL_SRUN, *srun, __ENTER__, *enter, "--", *command])
'''


def _write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def install(bindir: Path, state: Path, pyxis: bool = False) -> Path:
    """``bindir`` holding ``apptainer`` (and, with ``pyxis``, a ``srun`` that honours --container-*); ``state``
    is the JSON-lines file every container start appends to. Returns ``bindir`` (put it first on PATH)."""
    bindir.mkdir(parents=True, exist_ok=True)
    real_srun = shutil.which("srun", path=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != bindir))
    enter = _write_exe(bindir / "fake-container-enter", ENTER.replace("__PYTHON__", sys.executable).replace("__STATE__", repr(str(state))))
    _write_exe(bindir / "apptainer", APPTAINER.replace("__PYTHON__", sys.executable).replace("__ENTER__", repr(str(enter))))
    if pyxis:
        _write_exe(bindir / "srun", SRUN.replace("__PYTHON__", sys.executable).replace("__ENTER__", repr(str(enter)))
                   .replace("__REAL_SRUN__", repr(real_srun)))
    return bindir


def image_paths() -> list[str]:
    """What a fake image holds: the OS, this interpreter (venv and base) and the source checkout."""
    paths = ["/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc", os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), str(ROOT)]
    return [p for p in dict.fromkeys(paths) if os.path.lexists(p)]


def make_image(path: Path, extra: list[str] = ()) -> Path:
    path.write_text(json.dumps({"fake_image": [*image_paths(), *extra]}))
    return path


def starts(state: Path) -> list[dict]:
    return [json.loads(line) for line in state.read_text().splitlines()] if state.exists() else []
