"""sbatch's own option table, and the guard on ``slurm.extra_sbatch`` built on it (pure).

sbatch reads its options with ``getopt_long``: a long option may be abbreviated to any prefix that
matches one option only (``--no-req`` is ``--no-requeue``, ``--arr`` is ``--array``); an exact name wins
over longer ones (``--mem`` is not ambiguous with ``--mem-per-cpu``); a prefix of several options is
refused. Short options (``-N 2``) and ``--opt value`` as two words are further spellings. So a guard
that compares names as written lets every owned option back in. This module resolves an entry the way
sbatch does, against the union of sbatch's long options in Slurm 22.05 to 24.11 (``man sbatch`` and
``src/common/slurm_opt.c`` of those releases), refuses every spelling of an option swiftslurm sets
(naming the key to use), refuses unknown, ambiguous and short forms, and gives back the option under
its full name, so the script never depends on how a given sbatch resolves an abbreviation.
"""

from __future__ import annotations

import re

from ..errors import did_you_mean

REQ, OPT, NONE = "required", "optional", "none"  # getopt's has_arg

# long name -> (short letter or "", argument). Aliases map through SBATCH_ALIASES.
SBATCH_OPTIONS: dict[str, tuple[str, str]] = {
    "account": ("A", REQ), "acctg-freq": ("", REQ), "array": ("a", REQ), "batch": ("", REQ),
    "bb": ("", REQ), "bbf": ("", REQ), "begin": ("b", REQ), "chdir": ("D", REQ),
    "cluster-constraint": ("", REQ), "clusters": ("M", REQ), "comment": ("", REQ), "constraint": ("C", REQ),
    "container": ("", REQ), "container-id": ("", REQ), "contiguous": ("", NONE), "core-spec": ("S", REQ),
    "cores-per-socket": ("", REQ), "cpu-freq": ("", REQ), "cpus-per-gpu": ("", REQ), "cpus-per-task": ("c", REQ),
    "deadline": ("", REQ), "delay-boot": ("", REQ), "dependency": ("d", REQ), "distribution": ("m", REQ),
    "error": ("e", REQ), "exclude": ("x", REQ), "exclusive": ("", OPT), "export": ("", REQ),
    "export-file": ("", REQ), "extra": ("", REQ), "extra-node-info": ("B", REQ), "get-user-env": ("", OPT),
    "gid": ("", REQ), "gpu-bind": ("", REQ), "gpu-freq": ("", REQ), "gpus": ("G", REQ),
    "gpus-per-node": ("", REQ), "gpus-per-socket": ("", REQ), "gpus-per-task": ("", REQ), "gres": ("", REQ),
    "gres-flags": ("", REQ), "help": ("h", NONE), "hint": ("", REQ), "hold": ("H", NONE),
    "ignore-pbs": ("", NONE), "input": ("i", REQ), "job-name": ("J", REQ), "kill-on-invalid-dep": ("", REQ),
    "licenses": ("L", REQ), "mail-type": ("", REQ), "mail-user": ("", REQ), "mcs-label": ("", REQ),
    "mem": ("", REQ), "mem-bind": ("", REQ), "mem-per-cpu": ("", REQ), "mem-per-gpu": ("", REQ),
    "mincpus": ("", REQ), "network": ("", REQ), "nice": ("", OPT), "no-kill": ("k", OPT),
    "no-requeue": ("", NONE), "nodefile": ("F", REQ), "nodelist": ("w", REQ), "nodes": ("N", REQ),
    "ntasks": ("n", REQ), "ntasks-per-core": ("", REQ), "ntasks-per-gpu": ("", REQ), "ntasks-per-node": ("", REQ),
    "ntasks-per-socket": ("", REQ), "oom-kill-step": ("", OPT), "open-mode": ("", REQ), "output": ("o", REQ),
    "overcommit": ("O", NONE), "oversubscribe": ("s", NONE), "parsable": ("", NONE), "partition": ("p", REQ),
    "power": ("", REQ), "prefer": ("", REQ), "priority": ("", REQ), "profile": ("", REQ),
    "propagate": ("", OPT), "qos": ("q", REQ), "quiet": ("Q", NONE), "reboot": ("", NONE),
    "requeue": ("", NONE), "reservation": ("", REQ), "segment": ("", REQ), "signal": ("", REQ),
    "sockets-per-node": ("", REQ), "spread-job": ("", NONE), "stepmgr": ("", NONE), "switches": ("", REQ),
    "test-only": ("", NONE), "thread-spec": ("", REQ), "threads-per-core": ("", REQ), "time": ("t", REQ),
    "time-min": ("", REQ), "tmp": ("", REQ), "tres-bind": ("", REQ), "tres-per-task": ("", REQ),
    "uid": ("", REQ), "usage": ("", NONE), "use-min-nodes": ("", NONE), "verbose": ("v", NONE),
    "version": ("V", NONE), "wait": ("W", NONE), "wait-all-nodes": ("", REQ), "wckey": ("", REQ),
    "wrap": ("", REQ),
}
# same option, two names (getopt: not ambiguous with each other); --tasks-per-node is an alias sbatch's help never names
SBATCH_ALIASES = {"cluster": "clusters", "tasks-per-node": "ntasks-per-node"}
SHORT_OPTIONS = {short: name for name, (short, _) in SBATCH_OPTIONS.items() if short}

# Options swiftslurm sets from spec keys, or that break how it submits and follows a job:
# every spelling of these is refused, with what to do instead.
OWNED_SBATCH_OPTIONS = {
    "job-name": "use job.name", "nodes": "use slurm.nodes", "ntasks-per-node": "use slurm.tasks_per_node",
    "ntasks": "use slurm.nodes and slurm.tasks_per_node", "ntasks-per-core": "use slurm.tasks_per_node",
    "ntasks-per-socket": "use slurm.tasks_per_node", "ntasks-per-gpu": "use slurm.tasks_per_node",
    "gpus-per-node": "use slurm.gpus_per_node", "gpus": "use slurm.gpus_per_node (GPUs per node, one rank each)",
    "gpus-per-task": "use slurm.gpus_per_node (one rank per GPU)", "gpus-per-socket": "use slurm.gpus_per_node",
    "cpus-per-task": "use slurm.cpus_per_task", "cpus-per-gpu": "use slurm.cpus_per_task",
    "tres-per-task": "use slurm.cpus_per_task and slurm.gpus_per_node",
    "mem": "use slurm.mem", "time": "use slurm.time",
    "partition": "use slurm.partition", "account": "use slurm.account", "qos": "use slurm.qos",
    "constraint": "use slurm.constraint", "exclude": "use slurm.exclude", "nodelist": "use slurm.nodelist",
    "nodefile": "use slurm.nodelist", "reservation": "use slurm.reservation", "signal": "use slurm.signal_grace_s",
    "array": "use [sweep] (and slurm.array_parallelism)",
    "output": "logs go under job.output_dir", "error": "logs go under job.output_dir",
    "open-mode": "logs are always appended (a requeued run continues its log)",
    "requeue": "requeue is always on: walltime stops resume through it",
    "no-requeue": "requeue is how walltime stops resume; set slurm.max_requeues = 0 to never requeue",
    "export": "use [env]; --export=NONE would keep [env] and PATH from the ranks",
    "export-file": "use [env]", "chdir": "run swiftslurm from the directory the job should start in",
    "wrap": "the batch script is swiftslurm's (train.command runs your own program)",
    "parsable": "swiftslurm reads sbatch's answer itself", "wait": "use `swiftslurm submit --wait`",
    "test-only": "use `swiftslurm plan` to see what would be sent",
    "clusters": "run swiftslurm on the other cluster's login node (status and cancel ask the local one)",
    "help": "not a job option", "usage": "not a job option", "version": "not a job option",
}
# Not owned, but in conflict with a key when that key is set (checked next to the fields).
MEM_CONFLICTS = ("mem-per-cpu", "mem-per-gpu")

_ENTRY_RE = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.DOTALL)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_GPU_GRES_RE = re.compile(r"(?:^|,)(?:gres/)?gpu(?:[:,]|$)")


def resolve_long(name: str) -> tuple[str | None, list[str]]:
    """``name`` (as written after ``--``) resolved as sbatch's getopt_long does: (full name | None, candidates)."""
    if name in SBATCH_OPTIONS:
        return name, [name]
    if name in SBATCH_ALIASES:
        return SBATCH_ALIASES[name], [name]
    matches = sorted({SBATCH_ALIASES.get(o, o) for o in [*SBATCH_OPTIONS, *SBATCH_ALIASES] if o.startswith(name)})
    return (matches[0] if len(matches) == 1 else None), matches


def _owned(options: list[str], opt: str, spelled: str, candidates: list[str] | None = None) -> str:
    """The refusal of an entry that is (or may be) an owned option, with what to do for each."""
    candidates = candidates or options
    if len(candidates) == 1 and spelled == f"--{options[0]}":
        how = ""
    elif len(candidates) == 1:
        how = f"{spelled} is sbatch's --{options[0]}; "
    else:
        how = f"{spelled} abbreviates {', '.join('--' + o for o in candidates)}; "
    hints = "; ".join(f"--{o}: {OWNED_SBATCH_OPTIONS[o]}" if len(options) > 1 else OWNED_SBATCH_OPTIONS[o] for o in options)
    return f"{opt!r}: {how}set by swiftslurm, not through extra_sbatch. HINT: {hints}"


def parse_extra(opt: str) -> tuple[str, str | None]:
    """One ``extra_sbatch`` entry as (full option name, value | None), or ValueError saying what to write.

    Refused: short options, ``--opt value`` split in two, unknown or ambiguous names, every spelling of an
    option in OWNED_SBATCH_OPTIONS, a value on a flag or none on an option that needs one, control
    characters, and ``--gres`` asking for GPUs (slurm.gpus_per_node does).
    """
    if not isinstance(opt, str) or not opt.startswith("-"):
        raise ValueError(f"each entry as '--key=value' or '--flag', not {opt!r} (write '--key=value' as one entry, not two)")
    if _CONTROL_RE.search(opt):
        raise ValueError(f"{opt!r}: no line breaks, tabs or other control characters")
    if not opt.startswith("--"):
        letter = opt[1:2]
        name = SHORT_OPTIONS.get(letter)
        if name in OWNED_SBATCH_OPTIONS:
            raise ValueError(_owned([name], opt, f"-{letter}"))
        long_form = f" (here: --{name}{'' if SBATCH_OPTIONS[name][1] == NONE else '=...'})" if name else ""
        raise ValueError(f"{opt!r}: write sbatch options in their long form '--key=value'{long_form}")
    m = _ENTRY_RE.fullmatch(opt)
    if not m:
        raise ValueError(f"each entry as '--key=value' or '--flag' (lower-case option name), not {opt!r}")
    written, value = m.group(1), m.group(2)
    option, candidates = resolve_long(written)
    if option is None and not candidates:
        close = did_you_mean(written, [*SBATCH_OPTIONS, *SBATCH_ALIASES])
        raise ValueError(f"{opt!r}: sbatch has no option --{written}" + (f"; {close}" if close else ""))
    if option is None:
        if any(c in OWNED_SBATCH_OPTIONS for c in candidates):
            raise ValueError(_owned([c for c in candidates if c in OWNED_SBATCH_OPTIONS], opt, f"--{written}", candidates))
        raise ValueError(f"{opt!r}: --{written} is ambiguous (sbatch refuses it): it abbreviates "
                         f"{', '.join('--' + c for c in candidates)}; write the option in full")
    if option in OWNED_SBATCH_OPTIONS:
        raise ValueError(_owned([option], opt, f"--{written}"))
    kind = SBATCH_OPTIONS[option][1]
    if kind == NONE and value is not None:
        raise ValueError(f"{opt!r}: --{option} is a flag and takes no value; write '--{option}'")
    if kind == REQ and value is None:
        raise ValueError(f"{opt!r}: --{option} needs a value; write '--{option}=VALUE' as one entry")
    if option == "gres" and value is not None and _GPU_GRES_RE.search(value):
        raise ValueError(f"{opt!r}: GPUs are requested by swiftslurm, not through --gres. HINT: use slurm.gpus_per_node "
                         "(other generic resources may stay in --gres)")
    return option, value
