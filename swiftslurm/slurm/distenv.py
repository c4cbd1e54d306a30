"""The distributed environment of one rank, derived from the environment its launcher gives it: Slurm
(an srun task), submitit's local executor, or torchrun (and launchers that set torchrun's variables:
SkyPilot, the test launcher ``train/launch.py``).

Pure: ``derive(env)`` reads a mapping and returns a ``DistEnv``; ``check_allocation`` compares it
with the spec; ``child_env`` builds (and returns) the environment a rank's trainer runs with. Nothing
here reads or writes ``os.environ``: the caller passes it in and applies the result (STYLE.md, 7).

Which launcher, first match wins (``derive``):

1. submitit's local executor (``SUBMITIT_EXECUTOR=local`` or ``SUBMITIT_LOCAL_JOB_ID``);
2. torchrun itself (``TORCHELASTIC_RUN_ID`` with ``RANK`` and ``WORLD_SIZE``), even inside a Slurm step:
   ``srun torchrun ...`` starts one Slurm task per node, so ``SLURM_PROCID`` numbers nodes, not ranks;
3. a Slurm job step (``SLURM_JOB_ID`` and ``SLURM_PROCID``): Slurm's variables win over any ``RANK`` or
   ``WORLD_SIZE`` in the environment (sbatch exports the submitting shell's, which are nobody's choice);
4. torchrun's variables without torchrun (``RANK`` and ``WORLD_SIZE``);
5. nothing: a single process.
"""

from __future__ import annotations

import random
import re
import socket
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import hostlist

from ..errors import RuntimeEnvError
from ..spec.model import PER_RANK_VARS, RUNTIME_VARS, explicit_master_port

if TYPE_CHECKING:
    from ..spec.model import JobSpec

# Every job gets a slot of PORTS_PER_JOB ports: MASTER_PORT, then the preflight's store, test listener and
# iperf3 server (preflight/coord.py). The slots fill [16384, 32768): below Linux's ephemeral range (default
# 32768-60999, net.ipv4.ip_local_port_range), where any outgoing connection may hold a port at the moment
# the trainer wants to bind it, and above the well-known services. 4096 consecutive job ids never share a
# port; runtime.check_master_port says so when a node's ephemeral range (or another process) still hits it.
PORT_BASE = 16384
PORTS_PER_JOB = 4
PORT_SLOTS = 4096
PORT_SPAN = PORT_SLOTS * PORTS_PER_JOB  # master ports live in [16384, 32767]
EPHEMERAL_DEFAULT = (32768, 60999)
# Ports for processes that pick their own (the local launcher, tests): [8192, 16384), also below the
# ephemeral range, so a port found free is not handed to an outgoing connection before its server binds it.
FREE_PORT_RANGE = (8192, PORT_BASE)

# PER_RANK_VARS: variables every rank gets (or derives) on its own; one job-wide [env] table cannot set them.
# The spec holds the list (validate refuses them), the nodes read the same one (re-exported here).

# Defaults that make hangs and failures visible; the spec's [env] wins over them.
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed/timed-out collective aborts the job, not hangs it
    "DEEPSPEED_TIMEOUT": "30",  # minutes; DeepSpeed's process-group timeout (its default is 10)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # on a collective timeout, dump the flight recorder
    "TORCH_FR_BUFFER_SIZE": "2000",  # flight recorder: the last 2000 collectives per rank
}
FR_DUMP_NAME = "nccl_trace_rank_"  # flight-recorder dumps: <task dir>/logs/<this><rank>[.json]
# Not set: NCCL_ASYNC_ERROR_HANDLING, TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE, the
# pre-2.2 / deprecated names of the same settings: torch >= 2.2 reads the names above, and prints a
# deprecation warning on every rank when the old ones are set.


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    nodes: tuple[str, ...]  # expanded host names, allocation order
    node: str  # this rank's node name (SLURMD_NODENAME on Slurm)
    master_addr: str
    master_port: int
    job_id: str  # Slurm job id ("123"), or "local-<pid>" under the local executor
    requeue_id: str  # what `scontrol requeue` takes: "123" or "<array job>_<task>"
    array_task_id: int | None
    restart_count: int  # SLURM_RESTART_COUNT or 0
    gpus: tuple[str, ...]  # GPU ids visible on this node to this rank (() on CPU)
    executor: str  # "slurm" | "local" | "torchrun"
    gpu: str = ""  # the one GPU this rank drives (its LOCAL_RANK-th visible GPU); "" on CPU

    def summary(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.nnodes} {self.node}), master {self.master_addr}:{self.master_port}"
        )


# ---------------------------------------------------------------- pure parsers


def expand_nodelist(text: str, source: str = "SLURM_JOB_NODELIST") -> tuple[str, ...]:
    """Every Slurm hostlist form (``gpu[001-004,010],cpu-a[1-2]``) to host names, in order."""
    if not text or not text.strip():
        raise RuntimeEnvError(
            f"{source} is empty",
            repr(text),
            "run inside a Slurm allocation (sbatch/srun), or through `swiftslurm submit --executor local`",
        )
    try:
        hosts = hostlist.expand_hostlist(text.strip(), allow_duplicates=True)
    except hostlist.BadHostlist as exc:
        raise RuntimeEnvError(
            f"{source} is not a valid Slurm hostlist ({exc})",
            repr(text),
            "a hostlist looks like 'node1', 'node[1-4]' or 'gpu[001-004,010],cpu-a[1-2]'",
        ) from None
    if not hosts or any(not h or any(c in h for c in " []") for h in hosts):
        raise RuntimeEnvError(f"{source} is not a valid Slurm hostlist", repr(text), "a hostlist looks like 'node[1-4]'")
    return tuple(hosts)


_TPN_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(text: str) -> tuple[int, ...]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) to one count per node: (2, 2, 2, 1)."""
    counts: list[int] = []
    for part in text.split(","):
        m = _TPN_RE.fullmatch(part.strip())
        if not m:
            raise RuntimeEnvError("SLURM_TASKS_PER_NODE is not in Slurm's 'N(xM),K' form", repr(text), "is this a Slurm job step?")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(counts)


def port_for_job(job_id: str) -> int:
    """A master port from the job id: the same for every requeue of a job (Slurm keeps its id),
    different for two jobs (or array tasks: each has its own SLURM_JOB_ID) sharing a node.

    Numeric ids map to one of PORT_SLOTS slots, so 4096 consecutive jobs never collide; the port is the
    first of its slot, the preflight takes the other three.
    """
    key = job_id.strip()
    number = int(key) if key.isascii() and key.isdigit() else zlib.crc32(key.encode())
    return PORT_BASE + (number % PORT_SLOTS) * PORTS_PER_JOB


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``/proc/sys/net/ipv4/ip_local_port_range`` ("32768\t60999") -> (32768, 60999); None if unreadable."""
    parts = text.split()
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    low, high = int(parts[0]), int(parts[1])
    return (low, high) if low <= high else None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise RuntimeEnvError(f"{name} is not set", "", "`swiftslurm run` runs inside a Slurm job step (srun) or the local executor")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeEnvError(f"{name} is not an integer", repr(value), "is this environment from Slurm?") from None


def _explicit_port(explicit: Mapping[str, str]) -> int | None:
    value = explicit.get("MASTER_PORT", "")
    try:
        return explicit_master_port(value)
    except ValueError:
        raise RuntimeEnvError("MASTER_PORT in [env] is not a port number (1-65532)", repr(value.strip()),
                              "remove MASTER_PORT from [env] to let swiftslurm derive one from the job id") from None


def _master(explicit: Mapping[str, str], default_addr: str, job_key: str) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT): the spec's [env] choice, else derived. An inherited MASTER_ADDR/PORT
    (a login shell's, which sbatch exports to the job) is ignored: it is nobody's choice for this job."""
    port = _explicit_port(explicit)
    addr = explicit.get("MASTER_ADDR", "").strip()
    return addr or default_addr, port if port is not None else port_for_job(job_key)


def visible_gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    value = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not value or value in ("-1", "NoDevFiles"):
        return ()
    return tuple(g.strip() for g in value.split(",") if g.strip())


def bind_gpu(gpus: tuple[str, ...], local_rank: int, local_world_size: int) -> str:
    """The GPU a rank drives: its own when Slurm bound one per task, else its LOCAL_RANK-th."""
    if not gpus:
        return ""
    if len(gpus) == 1:
        return gpus[0]
    return gpus[local_rank] if local_rank < len(gpus) else ""


# ---------------------------------------------------------------- derive


def derive(env: Mapping[str, str], pid: int | None = None, explicit: Mapping[str, str] | None = None) -> DistEnv:
    """The rank's distributed environment from SLURM_* (an srun task), SUBMITIT_LOCAL_* (submitit's
    local executor), torchrun's RANK/WORLD_SIZE/... or nothing (a single process, ``pid`` names it); which
    one wins: the module docstring. Raises RuntimeEnvError.

    MASTER_ADDR/MASTER_PORT come from ``explicit`` (the spec's [env]) or are derived; under Slurm and the
    local executor the same names in ``env`` are ignored (inherited from whoever ran sbatch, they would make
    every job share a port), under torchrun they are its rendezvous and used.
    """
    explicit = explicit or {}
    torchrun_vars = "RANK" in env and "WORLD_SIZE" in env
    if env.get("SUBMITIT_EXECUTOR") == "local" or "SUBMITIT_LOCAL_JOB_ID" in env:
        return _derive_local(env, explicit)
    if torchrun_vars and env.get("TORCHELASTIC_RUN_ID"):
        return _derive_torchrun(env, explicit)
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        return _derive_slurm(env, explicit)
    if torchrun_vars:
        return _derive_torchrun(env, explicit)
    return _derive_single(env, pid, explicit)


def _derive_slurm(env: Mapping[str, str], explicit: Mapping[str, str]) -> DistEnv:
    source = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodes = expand_nodelist(env.get(source, ""), source)
    rank = _int(env, "SLURM_PROCID")
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    node_rank = _int(env, "SLURM_NODEID", 0)
    node = env.get("SLURMD_NODENAME") or (nodes[node_rank] if node_rank < len(nodes) else "")
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    per_node = expand_tasks_per_node(tpn) if tpn else (world_size // max(len(nodes), 1),) * len(nodes)
    local_world_size = per_node[node_rank] if node_rank < len(per_node) else 1
    local_rank = _int(env, "SLURM_LOCALID", 0)
    if not env.get("SLURM_STEP_ID") and world_size > 1:
        # the batch script (or an salloc shell) itself: one process standing in for the whole job
        raise RuntimeEnvError(
            f"`swiftslurm run` was started outside a job step, as one process for a job of {world_size} tasks",
            "SLURM_STEP_ID is unset (the batch script runs it directly)",
            "start it with `srun python -m swiftslurm run --plan PLAN` (one Slurm task per rank); "
            "`swiftslurm render SPEC -o FILE` writes such a script",
        )
    job_id = env["SLURM_JOB_ID"].strip()
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    array_task_id = _int(env, "SLURM_ARRAY_TASK_ID") if array_task else None
    gpus = visible_gpus(env)
    master_addr, master_port = _master(explicit, nodes[0], job_id)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        nnodes=_int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_JOB_NUM_NODES", len(nodes))) if nodes else 1,
        nodes=nodes,
        node=node,
        master_addr=master_addr,
        master_port=master_port,
        job_id=job_id,
        requeue_id=f"{array_job}_{array_task}" if array_job and array_task else job_id,
        array_task_id=array_task_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        gpus=gpus,
        executor="slurm",
        gpu=bind_gpu(gpus, local_rank, local_world_size),
    )


def _derive_local(env: Mapping[str, str], explicit: Mapping[str, str]) -> DistEnv:
    """submitit's LocalExecutor: one node, SUBMITIT_LOCAL_NTASKS ranks, the controller's pid as job id."""
    local_id = env.get("SUBMITIT_LOCAL_JOB_ID", "").strip() or "0"
    job_id = f"local-{local_id}"
    rank = _int(env, "SUBMITIT_LOCAL_GLOBALID", 0)
    local_rank = _int(env, "SUBMITIT_LOCAL_LOCALID", rank)
    world_size = _int(env, "SUBMITIT_LOCAL_NTASKS", 1)
    gpus = visible_gpus(env)
    master_addr, master_port = _master(explicit, "127.0.0.1", local_id)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=world_size,
        node_rank=0,
        nnodes=1,
        nodes=("localhost",),
        node="localhost",
        master_addr=master_addr,
        master_port=master_port,
        job_id=job_id,
        requeue_id=job_id,
        array_task_id=None,
        restart_count=0,
        gpus=gpus,
        executor="local",
        gpu=bind_gpu(gpus, local_rank, world_size),
    )


def _derive_torchrun(env: Mapping[str, str], explicit: Mapping[str, str]) -> DistEnv:
    """torchrun's worker variables (torch.distributed.run): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK / GROUP_WORLD_SIZE (the node's index and the node count; NODE_RANK / NNODES as other launchers
    name them), MASTER_ADDR / MASTER_PORT (the rendezvous), TORCHELASTIC_RUN_ID / _RESTART_COUNT. Only RANK
    and WORLD_SIZE are required; the rest defaults as for one node. torchrun does not name the other nodes:
    ``nodes`` holds this node's name at its index and ``node-<i>`` for the others."""
    rank = _int(env, "RANK")
    world_size = _int(env, "WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise RuntimeEnvError("RANK is not inside WORLD_SIZE", f"RANK={rank} WORLD_SIZE={world_size}",
                              "start the ranks with torchrun (it sets both), or set 0 <= RANK < WORLD_SIZE")
    group = "GROUP_WORLD_SIZE" if env.get("GROUP_WORLD_SIZE") else "NNODES"
    nnodes = _int(env, group, 1)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", max(world_size // max(nnodes, 1), 1))
    local_rank = _int(env, "LOCAL_RANK", rank % local_world_size)
    node_rank = _int(env, "GROUP_RANK" if env.get("GROUP_RANK") else "NODE_RANK", rank // local_world_size)
    node = env.get("SLURMD_NODENAME") or env.get("HOSTNAME") or "localhost"
    nodes = tuple(node if i == node_rank else f"node-{i}" for i in range(max(nnodes, node_rank + 1)))
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    env_port = env.get("MASTER_PORT", "").strip()
    # one id for every rank of the run: the Slurm job around it, torchrun's --rdzv-id, else the rendezvous port
    job_id = (env.get("SLURM_JOB_ID", "").strip() or (run_id if run_id not in ("", "none") else "")
              or f"torchrun-{env_port or 0}")
    master_addr = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    master_port = int(env_port) if env_port.isascii() and env_port.isdigit() else port_for_job(job_id)
    master_addr, master_port = explicit.get("MASTER_ADDR", "").strip() or master_addr, _explicit_port(explicit) or master_port
    gpus = visible_gpus(env)
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
        node_rank=node_rank, nnodes=nnodes, nodes=nodes, node=node,
        master_addr=master_addr, master_port=master_port,
        job_id=job_id, requeue_id=job_id, array_task_id=None,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        gpus=gpus, executor="torchrun", gpu=bind_gpu(gpus, local_rank, local_world_size),
    )  # fmt: skip


def _derive_single(env: Mapping[str, str], pid: int | None, explicit: Mapping[str, str]) -> DistEnv:
    job_id = f"local-{pid if pid is not None else 0}"
    master_addr, master_port = _master(explicit, "127.0.0.1", job_id)
    gpus = visible_gpus(env)
    return DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1,
        nodes=("localhost",), node="localhost",
        master_addr=master_addr, master_port=master_port,
        job_id=job_id, requeue_id=job_id, array_task_id=None, restart_count=0,
        gpus=gpus, executor="local", gpu=bind_gpu(gpus, 0, 1),
    )  # fmt: skip


# ---------------------------------------------------------------- checks and export


def check_allocation(dist: DistEnv, spec: JobSpec) -> None:
    """What Slurm granted vs what the spec asked; RuntimeEnvError with a HINT before any training."""
    want_nodes, want_tpn = spec.slurm.nodes, spec.slurm.ranks_per_node
    # torchrun, and the local executor (the whole job's ranks on this one machine): only the world size is theirs
    launchers = {
        "torchrun": ("the launcher", f"WORLD_SIZE={dist.world_size}; slurm.nodes={want_nodes} x tasks_per_node={want_tpn}",
                     f"start torchrun with --nnodes={want_nodes} --nproc-per-node={want_tpn}"),
        "local": ("the local executor", f"slurm.nodes={want_nodes} x tasks_per_node={want_tpn}",
                  f"submit with `swiftslurm submit --executor local` so it starts {spec.world_size} local ranks"),
    }
    if dist.executor in launchers:
        if dist.world_size != spec.world_size:
            who, found, hint = launchers[dist.executor]
            raise RuntimeEnvError(f"{who} started {dist.world_size} rank(s), the spec asks for {spec.world_size}", found, hint)
        return
    if dist.nnodes != want_nodes:
        raise RuntimeEnvError(
            f"Slurm granted {dist.nnodes} node(s), the spec asks for {want_nodes}",
            f"nodes {','.join(dist.nodes)}",
            f"set sbatch --nodes={want_nodes} (or [slurm] nodes = {dist.nnodes} in the spec)",
        )
    if dist.local_world_size != want_tpn:
        raise RuntimeEnvError(
            f"Slurm started {dist.local_world_size} task(s) on node {dist.node}, the spec asks for {want_tpn} per node",
            f"SLURM_TASKS_PER_NODE gives {dist.local_world_size} on node {dist.node_rank}",
            f"set sbatch/srun --ntasks-per-node={want_tpn} (or [slurm] tasks_per_node = {dist.local_world_size} in the spec)",
        )
    if dist.world_size != spec.world_size:
        raise RuntimeEnvError(
            f"the job step has {dist.world_size} task(s), the spec asks for {spec.world_size}",
            f"SLURM_NTASKS={dist.world_size}",
            f"set sbatch --ntasks={spec.world_size} or drop --ntasks and use --ntasks-per-node={want_tpn}",
        )
    want_gpus = spec.slurm.gpus_per_node
    if want_gpus and not dist.gpus:
        raise RuntimeEnvError(
            f"the spec asks for {want_gpus} GPU(s) per node, this task sees none",
            f"CUDA_VISIBLE_DEVICES unset on {dist.node}",
            f"set sbatch --gpus-per-node={want_gpus} on a GPU partition (or [slurm] gpus_per_node = 0 for a CPU run)",
        )
    if want_gpus and len(dist.gpus) not in (1, dist.local_world_size):
        raise RuntimeEnvError(
            f"rank {dist.rank} sees {len(dist.gpus)} GPU(s); one rank per GPU needs 1 or {dist.local_world_size}",
            f"CUDA_VISIBLE_DEVICES={','.join(dist.gpus)} on {dist.node}",
            f"set sbatch --gpus-per-node={want_gpus} with --ntasks-per-node={want_gpus} (and no --gpus-per-task mismatch)",
        )


def check_spec_env(spec_env: Mapping[str, str]) -> None:
    """The spec's [env] is job-wide; per-rank variables in it would give every rank the same rank."""
    bad = sorted(k for k in spec_env if k in PER_RANK_VARS or k in RUNTIME_VARS)
    if bad:
        raise RuntimeEnvError(
            f"[env] sets per-rank variable(s) {', '.join(bad)}",
            ", ".join(f"{k}={spec_env[k]}" for k in bad),
            "remove them from [env]: swiftslurm derives them from Slurm for every rank "
            "(MASTER_ADDR and MASTER_PORT may be set there)",
        )


def dist_vars(dist: DistEnv) -> dict[str, str]:
    """The torch.distributed env:// variables of this rank."""
    return {
        "RANK": str(dist.rank),
        "LOCAL_RANK": str(dist.local_rank),
        "WORLD_SIZE": str(dist.world_size),
        "LOCAL_WORLD_SIZE": str(dist.local_world_size),
        "NODE_RANK": str(dist.node_rank),
        "GROUP_RANK": str(dist.node_rank),
        "NNODES": str(dist.nnodes),
        "MASTER_ADDR": dist.master_addr,
        "MASTER_PORT": str(dist.master_port),
    }


def child_env(
    base_env: Mapping[str, str],
    dist: DistEnv,
    spec_env: Mapping[str, str],
    log_dir: str | None = None,
    pg_timeout_s: int | None = None,
) -> dict[str, str]:
    """The ONE export step: the environment the rank's trainer runs with. Later wins:

    base env < NCCL/torch defaults < derived dist vars < the spec's [env] (user wins), except that
    [env] may not set per-rank variables (RANK, LOCAL_RANK, ... : RuntimeEnvError). To change a
    default (say DEEPSPEED_TIMEOUT), set it in [env]. ``pg_timeout_s`` (train.ddp_timeout) sets
    DEEPSPEED_TIMEOUT, DeepSpeed's process-group timeout, in whole minutes rounded up.
    """
    check_spec_env(spec_env)
    out = dict(base_env)
    defaults = dict(NCCL_DEFAULTS)
    if log_dir:
        defaults["TORCH_FR_DUMP_TEMP_FILE"] = f"{log_dir}/{FR_DUMP_NAME}"
    if pg_timeout_s:
        defaults["DEEPSPEED_TIMEOUT"] = str(-(-pg_timeout_s // 60))
    cpus = base_env.get("SLURM_CPUS_PER_TASK", "")
    if "OMP_NUM_THREADS" not in base_env and cpus.isdigit() and int(cpus) > 0:
        # torch's intra-op threads, as torchrun sets them: the CPUs Slurm gave this task. Unset, every rank starts one
        # thread per core of the node, and without Slurm's CPU binding (TaskPlugin=task/none) the ranks of a node
        # oversubscribe its cores, their OpenMP threads spinning at each other's barriers
        defaults["OMP_NUM_THREADS"] = cpus
    out.update(defaults)
    out.update(dist_vars(dist))
    out.update(spec_env)
    return out


def free_port(addr: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port on ``addr`` that nothing listens on now, from ``FREE_PORT_RANGE`` (never the kernel's
    ephemeral range: binding port 0 returns one of those, which any outgoing connection may take before
    the caller's server binds it)."""
    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(*FREE_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    raise RuntimeEnvError(f"no free TCP port on {addr}", f"{tries} random ports in {FREE_PORT_RANGE[0]}-{FREE_PORT_RANGE[1] - 1} were taken",
                          "free some, or check what holds them (ss -ltnp)")
