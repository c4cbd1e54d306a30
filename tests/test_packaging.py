"""A non-editable install carries every module, the sbatch templates and the DeepSpeed presets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        check=True, capture_output=True, text=True, cwd=out,
    )
    (whl,) = out.glob("swiftslurm-*.whl")
    return whl


def test_wheel_holds_every_module_template_and_preset(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in (ROOT / "swiftslurm").rglob("*.py"):
        assert str(src.relative_to(ROOT)) in names, f"{src} is not packaged"
    for tpl in (ROOT / "templates").glob("*.j2"):
        assert f"swiftslurm/templates/{tpl.name}" in names
    presets = sorted(p.name for p in (ROOT / "ds_config").glob("*.json"))
    assert len(presets) == 8
    for p in presets:
        assert f"swiftslurm/ds_config/{p}" in names


def test_installed_wheel_validates_and_plans_outside_the_repo(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
    # run from the repo root (relative dataset paths), but import swiftslurm from the installed copy
    # (-P: the current directory does not shadow it)
    probe = subprocess.run([sys.executable, "-P", "-c", "import swiftslurm; print(swiftslurm.__file__)"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert probe.stdout.startswith(str(site)), probe.stdout
    r = subprocess.run([sys.executable, "-P", "-m", "swiftslurm", "validate", *examples], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr + r.stdout
    r = subprocess.run([sys.executable, "-P", "-m", "swiftslurm", "plan", "examples/sweep.toml", "--json"], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert len(plan["tasks"]) == 4 and plan["deepspeed"][0]["zero_optimization"]["stage"] == 2
    assert "#SBATCH" in plan["sbatch"]


# ------------------------------------------------------------ the wheel in a fresh venv, run inside and outside a clone

SOURCE_TREE = ("swiftslurm", "ds_config", "templates", "examples")


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv holding the wheel (not editable). Its dependencies come from the test venv's site-packages
    through a .pth line, which does not run that venv's editable-install finder (only site dirs run .pth files)."""
    import site
    import sysconfig

    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True, text=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]
    assert deps in site.getsitepackages() or deps == site.getusersitepackages() or Path(deps).is_dir()
    Path(purelib, "test-deps.pth").write_text(deps + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True)
    return python


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A source checkout as a user has it after `git clone` (the package folder next to ds_config/ and templates/)."""
    import shutil

    root = tmp_path_factory.mktemp("clone") / "swiftslurm-src"
    for name in SOURCE_TREE:
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def swiftslurm_cli(python: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(python), "-m", "swiftslurm", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.mark.parametrize("where", ["inside the clone", "outside"])
def test_the_installed_wheel_validates_plans_and_renders_inside_and_outside_a_clone(fresh_venv, clone, tmp_path, where):
    import shutil

    cwd = clone if where == "inside the clone" else tmp_path
    if cwd is tmp_path:
        shutil.copytree(clone / "examples", tmp_path / "examples")
    probe = subprocess.run([str(fresh_venv), "-c", "import swiftslurm; print(swiftslurm.__file__)"], capture_output=True, text=True,
                           cwd=cwd, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    # inside the clone, Python imports the clone's swiftslurm/ (the current directory comes first), where the
    # presets and templates are not subpackages: exactly what every rank of a job submitted from there does
    assert probe.stdout.startswith(str(clone if cwd is clone else fresh_venv.parents[1])), probe.stdout + probe.stderr
    for args in (["validate", "examples/quickstart.toml", "examples/sweep.toml"], ["plan", "examples/sweep.toml", "--json"],
                 ["render", "examples/quickstart.toml"]):
        r = swiftslurm_cli(fresh_venv, *args, cwd=cwd)
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
    r = swiftslurm_cli(fresh_venv, "plan", "examples/sweep.toml", "--json", cwd=cwd)
    assert json.loads(r.stdout)["deepspeed"][0]["zero_optimization"]["stage"] == 2


def test_ranks_started_from_inside_the_clone_find_the_presets(fresh_venv, clone):
    """The fast form of the next test: every rank validates its task's spec (the preset name included), so a
    `train.command` job shows the same failure in seconds."""
    (clone / "examples" / "cmd.toml").write_text(
        '[job]\nname = "cmd"\noutput_dir = "output/cmd"\n[slurm]\ntasks_per_node = 2\n[preflight]\nchecks = []\n'
        '[train]\ndeepspeed = "zero2"\ncommand = ["python", "-c", "pass"]\n')
    r = swiftslurm_cli(fresh_venv, "submit", "examples/cmd.toml", "--executor", "local", "--wait", cwd=clone, timeout=180)
    assert r.returncode == 0 and "ModuleNotFoundError" not in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_a_local_submit_from_inside_the_clone_runs_its_ranks(fresh_venv, clone):
    """`pip install .` then, inside the clone, `swiftslurm submit examples/quickstart.toml --executor local --wait`
    (shortened to 4 steps): the ranks import the clone's swiftslurm and must still find the presets."""
    import re

    text = (clone / "examples" / "quickstart.toml").read_text()
    text = re.sub(r"(?m)^max_steps = .*$", "max_steps = 4", text)
    text = re.sub(r"(?m)^save_steps = .*$", "save_steps = 2", text)
    text = re.sub(r"(?m)^checks = .*$", "checks = []", text)
    (clone / "examples" / "short.toml").write_text(text)
    r = swiftslurm_cli(fresh_venv, "submit", "examples/short.toml", "--executor", "local", "--wait", cwd=clone, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ModuleNotFoundError" not in r.stdout + r.stderr
    assert (clone / "output" / "quickstart" / "checkpoint-4").is_dir()


# extras that need a GPU stack (Triton): never installed in the CPU test venv, their floors are not checked here
GPU_ONLY_EXTRAS = {"liger"}


def test_setup_cfg_floors_are_in_the_major_versions_the_suite_runs_on():
    """A floor in an older major than the suite runs on (transformers>=4.46 for code on 5.x APIs) is a false promise."""
    import configparser
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement
    from packaging.version import Version

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for name, extra in cfg["options.extras_require"].items():
        if name not in GPU_ONLY_EXTRAS:
            lines += extra.splitlines()
    checked = 0
    for line in filter(None, (ln.strip() for ln in lines)):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        (spec,) = [s for s in req.specifier if s.operator == ">="]
        try:
            installed = Version(version(req.name))
        except PackageNotFoundError:
            pytest.fail(f"{req.name} is required by setup.cfg but not installed in the test venv")
        assert installed in req.specifier, f"{req}: the suite runs on {installed}"
        assert Version(spec.version).major == installed.major, f"{req}: the suite runs on {installed}; raise the floor"
        checked += 1
    assert checked >= 15
