"""Containers through fakes that enforce their mounts (tests/fake_container.py): a path we forget to mount is
missing inside, as on a real cluster, so the mounts swiftslurm renders are tested by running through them.

- apptainer: the local executor (no Slurm needed) runs `apptainer exec ...` as `slurm/launch.py` builds it;
- pyxis: a stand-in `srun` honours --container-image/--container-mounts/--container-workdir on the real
  cluster, for the submitit path and the rendered script under plain sbatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fake_container
import pytest
from test_submit_groups import cli, spec_text

from swiftslurm.jobs.send import Submission

WAIT_S = 180


def _runtime(tmp_path: Path, pyxis: bool = False) -> tuple[dict[str, str], Path, Path]:
    """PATH with the fakes first, the state file, and a fake image (the OS, this venv, the source checkout)."""
    state = tmp_path / "container-starts.jsonl"
    bindir = fake_container.install(tmp_path / "bin", state, pyxis=pyxis)
    image = fake_container.make_image(tmp_path / ("img.sqsh" if pyxis else "img.sif"))
    return {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}, state, image


def _container_spec(tmp_path: Path, runtime: str, image: Path, nodes: int = 1) -> str:
    """A command that reports what it sees: its cwd, a file of the ro data mount, whether an unmounted host
    file is visible, and whether it can write into the ro mount. The output dir is mounted automatically."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("from-data")
    (tmp_path / "secret.txt").write_text("host only")
    out = tmp_path / "out"
    probe = (f"r={out}/seen-$RANK; echo \"$(pwd)|$(cat x.txt)\" > $r; "
             f"if [ -e {tmp_path}/secret.txt ]; then echo visible >> $r; else echo hidden >> $r; fi; "
             f"if touch /data/w 2>/dev/null; then echo writable >> $r; else echo ro >> $r; fi")
    container = (f'[container]\nruntime = "{runtime}"\nimage = {json.dumps(str(image))}\n'
                 f'mounts = [{json.dumps(str(tmp_path / "data") + ":/data:ro")}]\nworkdir = "/data"\n')
    text = spec_text(str(out), ["sh", "-c", probe], nodes=nodes, extra=f"python = {json.dumps(sys.executable)}", sweep=container)
    (tmp_path / "s.toml").write_text(text)
    return str(out)


def test_fake_runtime_shows_only_what_is_bound(tmp_path):
    """The fake itself: a bound path is there (read-only when asked), an unbound one is not, a bad image fails."""
    env, state, image = _runtime(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("hi")

    def apptainer(*args):
        return subprocess.run(["apptainer", "exec", *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=30)

    bound = apptainer("--bind", f"{tmp_path}/d:/in:ro", str(image), "cat", "/in/f")
    assert (bound.returncode, bound.stdout) == (0, "hi"), bound.stderr
    unbound = apptainer(str(image), "cat", f"{tmp_path}/d/f")
    assert unbound.returncode != 0 and "No such file" in unbound.stderr
    ro = apptainer("--bind", f"{tmp_path}/d:/in:ro", str(image), "sh", "-c", "echo x > /in/g")
    assert ro.returncode != 0 and not (tmp_path / "d" / "g").exists()
    assert "working directory /nowhere" in apptainer("--pwd", "/nowhere", str(image), "true").stderr
    (tmp_path / "plain.sif").write_bytes(b"SIF")
    assert "could not open image" in apptainer(str(tmp_path / "plain.sif"), "true").stderr
    assert "mount source" in apptainer("--bind", "/nonexistent-x:/x", str(image), "true").stderr
    assert [s["command"][0] for s in fake_container.starts(state)] == ["cat", "cat", "sh", "true"]  # the --pwd failure is recorded: it mounted first


def test_apptainer_rank_runs_inside_its_mounts(tmp_path):
    """The local executor through `apptainer exec` as rendered: the rank reads the plan from the automatically
    mounted output dir, the command runs in container.workdir and sees the ro data mount, and nothing else."""
    env, state, image = _runtime(tmp_path)
    out = _container_spec(tmp_path, "apptainer", image)
    proc = cli("submit", "s.toml", "--executor", "local", "--wait", cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(out, "seen-0").read_text() == "/data|from-data\nhidden\nro\n"
    (start,) = fake_container.starts(state)
    assert start["binds"] == [f"{tmp_path}/data:/data:ro", f"{out}:{out}"]


@pytest.mark.slurm
def test_pyxis_ranks_run_inside_their_mounts_on_the_cluster(tmp_path):
    """2 nodes through a stand-in srun that honours pyxis' options: submitit's path and the rendered script."""
    env, state, image = _runtime(tmp_path, pyxis=True)
    out = _container_spec(tmp_path, "pyxis", image, nodes=2)
    proc = cli("submit", "s.toml", "--executor", "slurm", "--wait", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert Path(out, f"seen-{rank}").read_text() == "/data|from-data\nhidden\nro\n"
    starts = fake_container.starts(state)
    assert sorted(s["rank"] for s in starts) == ["0", "1"] and {s["runtime"] for s in starts} == {"pyxis"}
    assert all(s["binds"] == [f"{tmp_path}/data:/data:ro", f"{out}:{out}"] for s in starts)
    assert all(s["command"][:6] == [sys.executable, "-m", "swiftslurm.node.hold", "-u", "-m", "submitit.core._submit"] for s in starts)

    state.unlink()
    for rank in (0, 1):
        Path(out, f"seen-{rank}").unlink()
    assert cli("render", "s.toml", "-o", "job.sh", cwd=tmp_path, env=env).returncode == 0
    job = subprocess.run(["sbatch", "--parsable", str(tmp_path / "job.sh")], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True).stdout.strip()
    assert Submission("slurm", [job], out, [out], "").wait(timeout_s=WAIT_S, poll_s=0.5) == {"0": "COMPLETED"}
    assert [Path(out, f"seen-{r}").read_text() for r in (0, 1)] == ["/data|from-data\nhidden\nro\n"] * 2
    starts = fake_container.starts(state)
    assert len(starts) == 2 and all(s["command"][:4] == [sys.executable, "-m", "swiftslurm", "run"] for s in starts)
