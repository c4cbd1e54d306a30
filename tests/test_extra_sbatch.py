"""slurm.extra_sbatch is resolved the way sbatch's getopt_long resolves it: no spelling of an option
swiftslurm owns gets through, and what does get through reaches the script under its full name."""

from __future__ import annotations

import re
import string
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from swiftslurm.errors import SpecError
from swiftslurm.spec import parse_spec
from swiftslurm.spec.sbatch_options import NONE, OPT, OWNED_SBATCH_OPTIONS, REQ, SBATCH_ALIASES, SBATCH_OPTIONS, SHORT_OPTIONS, parse_extra, resolve_long

BASE = '[train]\ncommand = ["true"]\n'


def spec_with(extra: list[str], slurm: str = ""):
    entries = ", ".join(f"'{e}'" for e in extra)
    return parse_spec(f"[slurm]\n{slurm}\nextra_sbatch = [{entries}]\n" + BASE)


def refusal(extra: list[str], slurm: str = "") -> str:
    with pytest.raises(SpecError) as exc:
        spec_with(extra, slurm)
    problems = [p for p in exc.value.problems if p.path.startswith("slurm")]
    assert problems, exc.value.problems
    return problems[0].render()


@pytest.mark.parametrize("opt,key", [
    ("--no-req", "max_requeues"), ("--no-requeue", "max_requeues"), ("--requ", "requeue is always on"),
    ("--arr=0-3", "[sweep]"), ("--tasks-per-node=8", "slurm.tasks_per_node"), ("--tas=8", "slurm.tasks_per_node"),
    ("--sig=USR1@60", "slurm.signal_grace_s"), ("--nodel=node1", "slurm.nodelist"),
    ("--nodes=2", "slurm.nodes"), ("--node=2", "slurm.nodes"), ("--ntasks=4", "slurm.nodes and slurm.tasks_per_node"),
    ("--ntasks-per-n=2", "slurm.tasks_per_node"), ("--export=NONE", "[env]"), ("--exp=ALL", "[env]"),
    ("--gpus=8", "slurm.gpus_per_node"), ("--gpus-per-task=1", "slurm.gpus_per_node"), ("--gpus-per-n=4", "slurm.gpus_per_node"),
    ("--cpus-per-t=4", "slurm.cpus_per_task"), ("--output=x.log", "job.output_dir"), ("--err=x", "job.output_dir"),
    ("--chdir=/tmp", "directory"), ("--wrap=hostname", "batch script"), ("--parsable", "sbatch's answer"),
    ("--part=gpu", "slurm.partition"), ("--tim=10", "slurm.time"), ("--time=10", "slurm.time"), ("--job=x", "job.name"),
    ("--mem=10G", "slurm.mem"), ("--exc=node1", "slurm.exclude"), ("--wait", "submit --wait"), ("--clusters=b", "login node"),
    ("--cluster=b", "login node"), ("--tres-per-task=cpu=4", "slurm.cpus_per_task"), ("--open-mode=truncate", "appended"),
])
def test_every_spelling_of_an_owned_option_is_refused_with_the_key_to_use(opt, key):
    text = refusal([opt])
    assert "set by swiftslurm" in text and key in text, text


@pytest.mark.parametrize("opt,full", [("-N2", "nodes"), ("-N", "nodes"), ("-n4", "ntasks"), ("-t", "time"), ("-p", "partition"),
                                      ("-J", "job-name"), ("-o", "output"), ("-e", "error"), ("-a", "array"), ("-c", "cpus-per-task"),
                                      ("-G", "gpus"), ("-D", "chdir"), ("-w", "nodelist"), ("-x", "exclude"), ("-M", "clusters")])
def test_short_options_of_owned_options_are_refused_by_name(opt, full):
    text = refusal([opt])
    assert f"--{full}" in text and OWNED_SBATCH_OPTIONS[full] in text, text


def test_short_options_and_two_word_forms_are_refused():
    assert "long form" in refusal(["-H"]) and "--hold" in refusal(["-H"])
    assert "one entry" in refusal(["--comment", "hello"])  # "hello" is not an option: '--key=value' as one entry
    assert "needs a value" in refusal(["--comment"])  # would swallow the next #SBATCH option as its value
    assert "takes no value" in refusal(["--hold=yes"])


def test_ambiguous_and_unknown_prefixes_are_refused_like_sbatch_does():
    text = refusal(["--co=x"])  # comment, constraint, container, ... and --constraint is owned
    assert "set by swiftslurm" in text and "slurm.constraint" in text
    text = refusal(["--mail=a@b"])  # mail-type, mail-user: neither owned
    assert "ambiguous" in text and "--mail-type" in text and "--mail-user" in text
    assert "no option --nodez" in refusal(["--nodez=1"])
    assert "did you mean 'comment'" in refusal(["--coment=x"])
    assert "lower-case" in refusal(["--Comment=x"])


def test_gres_asking_for_gpus_is_refused_but_other_gres_pass():
    assert "slurm.gpus_per_node" in refusal(["--gres=gpu:4"])
    assert "slurm.gpus_per_node" in refusal(["--gres=nvme:1,gpu:a100:2"])
    assert spec_with(["--gres=nvme:1"]).slurm.extra_sbatch == ["--gres=nvme:1"]


def test_mem_per_cpu_conflicts_only_with_slurm_mem():
    assert spec_with(["--mem-per-cpu=4G"]).slurm.extra_sbatch == ["--mem-per-cpu=4G"]
    assert "both set the memory" in refusal(["--mem-per-c=4G"], 'mem = "64G"')


def test_allowed_options_keep_their_value_and_get_their_full_name():
    spec = spec_with(["--comm=a=b c", "--hol", "--mail-t=END", "--exclusive", "--exclusive=user", "--nice"])
    assert spec.slurm.extra_sbatch == ["--comment=a=b c", "--hold", "--mail-type=END", "--exclusive", "--exclusive=user", "--nice"]


def test_control_characters_in_an_entry_are_refused():
    for bad in ["--comment=a\tb", "--comment=a\x1bb", "--comment=a\rb"]:
        with pytest.raises(ValueError, match="control characters"):
            parse_extra(bad)


def test_the_option_table_resolves_like_getopt():
    assert resolve_long("mem") == ("mem", ["mem"])  # exact beats the longer --mem-per-cpu
    assert resolve_long("gpus") == ("gpus", ["gpus"])
    assert resolve_long("gpus-per-n")[0] == "gpus-per-node"
    assert resolve_long("cluster")[0] == "clusters"  # --cluster and --clusters are one option
    assert resolve_long("clu")[0] is None  # ... but --cluster-constraint makes --clu ambiguous
    assert resolve_long("nodel")[0] == "nodelist"
    assert resolve_long("no")[0] is None  # no-kill, no-requeue, nodefile, nodelist, nodes
    for name, (short, _) in SBATCH_OPTIONS.items():
        assert resolve_long(name)[0] == name
        if short:
            assert SHORT_OPTIONS[short] == name
    assert set(OWNED_SBATCH_OPTIONS) <= set(SBATCH_OPTIONS)


def test_render_writes_the_full_name(tmp_path):
    from swiftslurm.plan import make_plan
    from swiftslurm.slurm.render import render_sbatch

    spec = spec_with(["--comm=x", "--hol"])
    script = render_sbatch(make_plan(spec, {"slurm": {"extra_sbatch": ["--comm=x", "--hol"]}, "train": {"command": ["true"]}}, str(tmp_path)))
    assert "#SBATCH --comment=x\n" in script and "#SBATCH --hold\n" in script and "--comm=" not in script


# ---------------------------------------------------------------- the table against the test cluster's real sbatch

# Options of the table that Slurm 22.05 (the test cluster: Debian 12's slurm-wlm) does not have yet
NEWER_THAN_22_05 = {"container-id", "oom-kill-step", "segment", "stepmgr", "tres-bind", "tres-per-task"}


def real_sbatch(tmp_path, *args: str) -> str:
    """What the real sbatch says to ``--test-only --wrap=true ARGS`` (getopt's complaints, or the test's answer)."""
    proc = subprocess.run(["sbatch", "--test-only", "--wrap=true", *args], capture_output=True, text=True, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, timeout=30)
    return proc.stderr + proc.stdout


def real_kind(tmp_path, name: str) -> str | None:
    """getopt's has_arg of --name in the real sbatch, from its complaints: None when sbatch does not know it."""
    with_value = real_sbatch(tmp_path, f"--{name}=x")
    if "unrecognized option" in with_value:
        return None
    if "doesn't allow an argument" in with_value:
        return NONE
    return REQ if "requires an argument" in real_sbatch(tmp_path, f"--{name}") else OPT


@pytest.mark.slurm
def test_the_option_table_matches_the_real_sbatch(slurm_cluster, tmp_path):
    """Every option the real sbatch names is in the table with its short letter; every option of the table takes
    an argument in the real sbatch as the table says (or is one of a later Slurm); every abbreviation the table
    resolves to one option is not ambiguous to the real sbatch (an option the table lacked would make it so)."""
    version = tuple(int(p) for p in re.search(r"(\d+)\.(\d+)", subprocess.run(["sbatch", "--version"], capture_output=True,
                                                                            text=True, timeout=30).stdout).groups())
    helptext = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, timeout=30).stdout
    usage = subprocess.run(["sbatch", "--usage"], capture_output=True, text=True, timeout=30).stdout
    named = set(re.findall(r"--([a-z][a-z0-9-]+)", helptext + usage))
    assert named - set(SBATCH_OPTIONS) - set(SBATCH_ALIASES) == set(), "options of the real sbatch missing from the table"
    shorts = dict((name, letter) for letter, name in re.findall(r"^\s+-([A-Za-z]), --([a-z][a-z0-9-]+)", helptext, re.M))
    assert shorts and {n: SBATCH_OPTIONS[n][0] for n in shorts} == shorts

    names = [*SBATCH_OPTIONS, *SBATCH_ALIASES]
    with ThreadPoolExecutor(8) as pool:
        kinds = dict(zip(names, pool.map(lambda n: real_kind(tmp_path, n), names), strict=True))
    unknown = {n for n, kind in kinds.items() if kind is None}
    if version == (22, 5):
        assert unknown == NEWER_THAN_22_05
    else:
        assert unknown <= NEWER_THAN_22_05, f"Slurm {version} lacks {unknown - NEWER_THAN_22_05} of the table"
    table_kind = {n: SBATCH_OPTIONS[SBATCH_ALIASES.get(n, n)][1] for n in names}
    assert {n: k for n, k in kinds.items() if k is not None} == {n: table_kind[n] for n in names if n not in unknown}

    prefixes = sorted({name[:i] for name in names if name not in unknown for i in range(2, len(name)) if resolve_long(name[:i])[0] is not None})
    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(prefixes, pool.map(lambda p: real_sbatch(tmp_path, f"--{p}=x"), prefixes), strict=True))
    ambiguous = {p: a.strip().splitlines()[0] for p, a in answers.items() if "is ambiguous" in a or "unrecognized option" in a}
    assert not ambiguous, ambiguous
    # an option the help does not name: every two letters the real sbatch knows an option by, the table knows too
    firsts = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase + "-"]
    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(firsts, pool.map(lambda p: real_sbatch(tmp_path, f"--{p}=x"), firsts), strict=True))
    real_firsts = {p for p, a in answers.items() if "unrecognized option" not in a}
    table_firsts = {n[:2] for n in names if n not in unknown}
    assert real_firsts == table_firsts, {"real sbatch only": real_firsts - table_firsts, "table only": table_firsts - real_firsts}
    assert len(prefixes) > 300 and "is ambiguous" in real_sbatch(tmp_path, "--no=x") and resolve_long("no")[0] is None
