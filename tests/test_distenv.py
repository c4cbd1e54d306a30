"""distenv: pure functions tested with env dicts, and hostlists checked against real scontrol."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftslurm.errors import RuntimeEnvError
from swiftslurm.slurm import distenv
from swiftslurm.slurm.distenv import check_allocation, child_env, derive, expand_nodelist, expand_tasks_per_node, port_for_job
from swiftslurm.spec import parse_spec

DATA = Path(__file__).parent / "data" / "hostlists"


def _captured() -> dict[str, list[str]]:
    """scontrol.txt (from capture.sh): '== FORM' then the host names scontrol printed."""
    out: dict[str, list[str]] = {}
    form = None
    for line in (DATA / "scontrol.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        if line.startswith("== "):
            form = line[3:]
            out[form] = []
        elif line:
            out[form].append(line)
    return out


CAPTURED = _captured()
FORMS = (DATA / "forms.txt").read_text().splitlines()


def test_table_covers_enough_forms():
    assert len(FORMS) >= 25
    assert list(CAPTURED) == FORMS
    assert all(CAPTURED[f] for f in FORMS), "every form in the table is one scontrol accepts"


@pytest.mark.parametrize("form", FORMS)
def test_hostlist_matches_captured_scontrol(form):
    assert list(expand_nodelist(form)) == CAPTURED[form]


@pytest.mark.slurm
def test_hostlist_matches_live_scontrol():
    from swiftslurm import slurm

    mismatches = {f: (slurm.show_hostnames(f), list(expand_nodelist(f))) for f in FORMS}
    mismatches = {f: v for f, v in mismatches.items() if v[0] != v[1]}
    assert not mismatches


@st.composite
def hostlists(draw) -> str:
    """Random Slurm hostlists: 1-3 groups, each a plain host or prefix[ranges] with zero padding."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        prefix = draw(st.from_regex(r"[a-z][a-z0-9-]{0,5}", fullmatch=True))
        if draw(st.booleans()):
            groups.append(prefix)
            continue
        width = draw(st.integers(1, 4))
        parts = []
        for _ in range(draw(st.integers(1, 3))):
            lo = draw(st.integers(0, 10**width - 1))
            hi = draw(st.integers(lo, min(lo + 4, 10**width - 1)))
            parts.append(f"{lo:0{width}d}" + (f"-{hi:0{width}d}" if hi > lo else ""))
        groups.append(f"{prefix}[{','.join(parts)}]")
    return ",".join(groups)


@pytest.mark.slurm
@settings(max_examples=60, deadline=None)
@given(hostlists())
def test_random_hostlists_match_live_scontrol(form):
    from swiftslurm import slurm

    assert list(expand_nodelist(form)) == slurm.show_hostnames(form)


MALFORMED = ["", "   ", "node[1-", "node[1-2", "node1]", "node[3-1]", "node[10-8]", "node[a-b]", "node[]", "no de1", "n[1-2]]"]


@pytest.mark.parametrize("form", MALFORMED)
def test_malformed_hostlist_names_the_input(form):
    with pytest.raises(RuntimeEnvError) as err:
        expand_nodelist(form, "SLURM_JOB_NODELIST")
    assert "SLURM_JOB_NODELIST" in err.value.what
    assert repr(form) in err.value.found
    assert err.value.hint


def test_forms_slurm_2205_refuses_are_expanded_like_newer_slurm():
    # Slurm 22.05's scontrol says "Invalid hostlist" to a suffix after brackets; Slurm never writes
    # such a SLURM_JOB_NODELIST itself, and python-hostlist expands it the way later Slurm does.
    assert expand_nodelist("node[1-3]-ib") == ("node1-ib", "node2-ib", "node3-ib")
    assert expand_nodelist("gpu[1-2].cluster") == ("gpu1.cluster", "gpu2.cluster")


@pytest.mark.parametrize(
    "text,counts",
    [("4", (4,)), ("2(x2)", (2, 2)), ("2(x3),1", (2, 2, 2, 1)), ("1,3(x2)", (1, 3, 3))],
)
def test_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_tasks_per_node_malformed():
    with pytest.raises(RuntimeEnvError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node("2(3)")


# ---------------------------------------------------------------- derive under Slurm


def slurm_env(**over: str) -> dict[str, str]:
    """An srun task's environment: 2 nodes x 2 tasks, this is rank 3 on node2 (as captured from srun)."""
    env = {
        "SLURM_JOB_ID": "4711",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURMD_NODENAME": "node2",
        "PATH": "/usr/bin",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_derive_slurm_ranks():
    d = derive(slurm_env())
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size) == (3, 1, 4, 2)
    assert (d.node_rank, d.nnodes, d.nodes, d.node) == (1, 2, ("node1", "node2"), "node2")
    assert d.master_addr == "node1"
    assert d.master_port == port_for_job("4711")
    assert (d.job_id, d.requeue_id, d.array_task_id, d.restart_count) == ("4711", "4711", None, 0)
    assert d.executor == "slurm" and d.gpus == () and d.gpu == ""


def test_step_nodelist_wins_over_job_nodelist():
    d = derive(slurm_env(SLURM_JOB_NODELIST="node[1-4]", SLURM_JOB_NUM_NODES="4"))
    assert d.nodes == ("node1", "node2") and d.nnodes == 2


def test_derive_array_task_and_requeue():
    d = derive(slurm_env(SLURM_JOB_ID="4713", SLURM_ARRAY_JOB_ID="4711", SLURM_ARRAY_TASK_ID="2", SLURM_RESTART_COUNT="3"))
    assert (d.requeue_id, d.array_task_id, d.restart_count) == ("4711_2", 2, 3)
    assert d.master_port == port_for_job("4713")  # each array task has its own job id, so its own port


def test_master_port_and_addr_from_spec_env_win():
    d = derive(slurm_env(), explicit={"MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.9"})
    assert (d.master_addr, d.master_port) == ("10.0.0.9", 29500)
    for bad in ("99999", "65533", "0", "port"):
        with pytest.raises(RuntimeEnvError, match=r"MASTER_PORT in \[env\]"):
            derive(slurm_env(), explicit={"MASTER_PORT": bad})


@pytest.mark.parametrize("make", [lambda **kw: slurm_env(**kw), lambda **kw: {"SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_NTASKS": "1", **kw},
                                  lambda **kw: dict(kw)])
def test_inherited_master_port_and_addr_are_ignored(make):
    # a login shell's MASTER_PORT/MASTER_ADDR reach the ranks through sbatch's default --export=ALL
    plain = derive(make(), pid=5)
    inherited = derive(make(MASTER_PORT="29500", MASTER_ADDR="10.9.9.9"), pid=5)
    assert (inherited.master_addr, inherited.master_port) == (plain.master_addr, plain.master_port)
    assert inherited.master_port != 29500 and inherited.master_addr != "10.9.9.9"
    assert child_env(make(MASTER_PORT="29500"), inherited, {})["MASTER_PORT"] == str(plain.master_port)


def test_uneven_tasks_per_node():
    d = derive(slurm_env(SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_PROCID="3", SLURM_LOCALID="0"))
    assert d.local_world_size == 1


def test_batch_script_without_srun_is_refused():
    # captured from a batch script of `sbatch -N2 --ntasks-per-node=2` (no SLURM_STEP_* there)
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[2-3]", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    with pytest.raises(RuntimeEnvError) as err:
        derive(env)
    assert "srun" in err.value.hint
    assert derive({**env, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "node2"}).world_size == 1


def test_bad_procid_is_a_clear_error():
    with pytest.raises(RuntimeEnvError, match="SLURM_PROCID"):
        derive(slurm_env(SLURM_PROCID="three"))


def test_ports_same_for_requeue_distinct_for_neighbours():
    # Slurm keeps the job id across `scontrol requeue`; two jobs have two ids.
    assert port_for_job("812") == port_for_job("812")
    from swiftslurm.preflight.coord import preflight_ports

    def job_ports(i: int) -> set[int]:  # MASTER_PORT and the preflight's three
        return {port_for_job(str(i)), *preflight_ports(port_for_job(str(i))).values()}

    seen: set[int] = set()
    for i in range(100000, 100000 + distenv.PORT_SLOTS):  # 4096 consecutive job ids never share a port
        mine = job_ports(i)
        assert len(mine) == 4 and not mine & seen
        seen |= mine
    assert not job_ports(7) & job_ports(7 + 1511)  # the preflight's old slots collided at ids equal mod 1511
    assert port_for_job("local-123") != port_for_job("local-124")


@given(st.one_of(st.integers(0, 2**40).map(str), st.text(min_size=1, max_size=30)))
def test_ports_below_the_ephemeral_range(job_id):
    from swiftslurm.preflight.coord import preflight_ports

    master = port_for_job(job_id)
    for port in (master, *preflight_ports(master).values()):
        assert 1024 < port < distenv.EPHEMERAL_DEFAULT[0]  # Linux's default range is 32768-60999


def test_ports_below_this_machines_ephemeral_range():
    text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
    low, _ = distenv.parse_port_range(text)
    assert distenv.PORT_BASE + distenv.PORT_SPAN <= low
    assert distenv.parse_port_range("32768\t60999\n") == (32768, 60999)
    assert distenv.parse_port_range("") is None and distenv.parse_port_range("9 1") is None


def test_gpu_binding():
    # Slurm with --gpus-per-node: every task sees the node's GPUs; the rank drives its LOCAL_RANK-th
    d = derive(slurm_env(CUDA_VISIBLE_DEVICES="0,1"))
    assert d.gpus == ("0", "1") and d.gpu == "1"
    # --gpu-bind=single / --gpus-per-task=1: each task sees its own one
    d = derive(slurm_env(CUDA_VISIBLE_DEVICES="5"))
    assert d.gpus == ("5",) and d.gpu == "5"


# ---------------------------------------------------------------- submitit local executor


def local_env(k: int, n: int = 2) -> dict[str, str]:
    """What submitit/local/_local.py sets for task k of n (SUBMITIT_LOCAL_JOB_ID = the controller's pid)."""
    return {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_NTASKS": str(n),
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_LOCALID": str(k),
        "SUBMITIT_LOCAL_GLOBALID": str(k),
        "SUBMITIT_LOCAL_JOB_ID": "31337",
        "CUDA_VISIBLE_DEVICES": "",
    }


def test_derive_submitit_local():
    d0, d1 = derive(local_env(0)), derive(local_env(1))
    assert (d1.rank, d1.local_rank, d1.world_size, d1.local_world_size, d1.nnodes) == (1, 1, 2, 2, 1)
    assert d0.master_addr == d1.master_addr == "127.0.0.1"
    assert d0.master_port == d1.master_port == port_for_job("31337")
    assert d0.job_id == "local-31337" and d0.executor == "local"


def test_local_wins_over_stray_slurm_vars():
    # submitting locally from inside a Slurm allocation leaves SLURM_* in the environment
    d = derive({**slurm_env(), **local_env(1)})
    assert d.executor == "local" and d.world_size == 2 and d.rank == 1


def test_single_process():
    d = derive({"PATH": "/bin"}, pid=42)
    assert (d.rank, d.world_size, d.job_id, d.master_addr) == (0, 1, "local-42", "127.0.0.1")


# ---------------------------------------------------------------- derive under torchrun (and launchers that set its variables)


def torchrun_env(rank: int = 5, **over: str) -> dict[str, str]:
    """A torchrun worker's variables (torch.distributed.run, --nnodes=2 --nproc-per-node=4): this is rank 5 on node 1."""
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank % 4), "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": str(rank // 4), "GROUP_WORLD_SIZE": "2", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu-a", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "run7", "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3", "PATH": "/usr/bin",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_derive_torchrun_ranks():
    d = derive(torchrun_env(HOSTNAME="gpu-b"))
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size) == (5, 1, 8, 4)
    assert (d.node_rank, d.nnodes, d.node, d.nodes) == (1, 2, "gpu-b", ("node-0", "gpu-b"))
    assert (d.master_addr, d.master_port) == ("gpu-a", 29400)  # torchrun's rendezvous, not an inherited one
    assert (d.job_id, d.requeue_id, d.restart_count, d.executor) == ("run7", "run7", 1, "torchrun")
    assert distenv.dist_vars(d) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1",
                               "GROUP_RANK": "1", "NNODES": "2", "MASTER_ADDR": "gpu-a", "MASTER_PORT": "29400"}


def test_torchrun_inside_a_slurm_step_wins():
    """`srun torchrun ...`: one Slurm task per node, so SLURM_PROCID numbers nodes; torchrun's RANK is the rank."""
    env = {**slurm_env(SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2",
                       SLURM_TASKS_PER_NODE="1(x2)", SLURM_STEP_TASKS_PER_NODE="1(x2)"), **torchrun_env(6)}
    d = derive(env)
    assert (d.rank, d.world_size, d.local_rank, d.node, d.executor) == (6, 8, 2, "node2", "torchrun")
    assert d.job_id == "4711"  # the Slurm job around the run names it


def test_slurm_wins_over_inherited_torchrun_style_vars():
    """A Slurm step without torchrun: RANK/WORLD_SIZE in the environment came from the submitting shell."""
    d = derive(slurm_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
    assert (d.rank, d.world_size, d.executor) == (3, 4, "slurm")


def test_torchrun_style_vars_without_torchrun_and_defaults():
    """SkyPilot or a hand-written launcher: RANK and WORLD_SIZE alone; the rest as for one node."""
    d = derive({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "12345"}, pid=9)
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size, d.node_rank, d.nnodes) == (1, 1, 2, 2, 0, 1)
    assert (d.master_addr, d.master_port, d.job_id, d.node, d.executor) == ("127.0.0.1", 12345, "torchrun-12345", "localhost", "torchrun")
    d = derive({"RANK": "3", "WORLD_SIZE": "4", "NODE_RANK": "1", "NNODES": "2", "MASTER_ADDR": "h0"})
    assert (d.local_rank, d.local_world_size, d.node_rank, d.nnodes, d.nodes) == (1, 2, 1, 2, ("node-0", "localhost"))
    assert d.master_port == port_for_job("torchrun-0")
    d = derive(torchrun_env(TORCHELASTIC_RUN_ID="none"))  # torchrun's default --rdzv-id: name the run by its port
    assert d.job_id == "torchrun-29400"


def test_torchrun_explicit_master_wins_and_bad_values_are_clear():
    d = derive(torchrun_env(), explicit={"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500"})
    assert (d.master_addr, d.master_port) == ("10.0.0.9", 29500)
    for bad in ({"RANK": "8"}, {"RANK": "-1"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(RuntimeEnvError, match="RANK is not inside WORLD_SIZE"):
            derive(torchrun_env(**bad))
    with pytest.raises(RuntimeEnvError, match="LOCAL_RANK is not an integer"):
        derive(torchrun_env(LOCAL_RANK="x"))


def test_the_test_launcher_gives_its_ranks_what_torchrun_gives():
    """train/launch.py starts its ranks with torchrun's variables; derive turns them into the same ranks."""
    from swiftslurm.train.launch import torchrun_vars

    ranks = [derive(torchrun_vars(rank, 3, 12000)) for rank in range(3)]
    assert [(d.rank, d.local_rank, d.world_size, d.local_world_size, d.node_rank, d.nnodes) for d in ranks] == [
        (r, r, 3, 3, 0, 1) for r in range(3)]
    assert {(d.master_addr, d.master_port, d.job_id, d.executor) for d in ranks} == {("127.0.0.1", 12000, ranks[0].job_id, "torchrun")}
    check_allocation(ranks[0], spec_of("nodes = 1\ntasks_per_node = 3"))


def test_torchrun_allocation_compares_the_world_size():
    check_allocation(derive(torchrun_env()), spec_of("nodes = 2\ntasks_per_node = 4"))
    with pytest.raises(RuntimeEnvError) as err:
        check_allocation(derive(torchrun_env()), spec_of())
    assert "--nnodes=2 --nproc-per-node=2" in err.value.hint


# ---------------------------------------------------------------- check_allocation


def spec_of(slurm: str = "nodes = 2\ntasks_per_node = 2") -> object:
    return parse_spec(f'[slurm]\n{slurm}\n[train]\ncommand = ["true"]\n')


def test_allocation_matches():
    check_allocation(derive(slurm_env()), spec_of())


def test_allocation_one_task_per_node_but_spec_says_two():
    env = slurm_env(SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_TASKS_PER_NODE="1(x2)", SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_PROCID="1",
                    SLURM_LOCALID="0")
    with pytest.raises(RuntimeEnvError) as err:
        check_allocation(derive(env), spec_of())
    assert "--ntasks-per-node=2" in err.value.hint and "tasks_per_node" in err.value.hint


def test_allocation_wrong_node_count():
    env = slurm_env(SLURM_STEP_NODELIST="node1", SLURM_STEP_NUM_NODES="1", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1",
                    SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_STEP_TASKS_PER_NODE="2",
                    SLURM_PROCID="1", SLURM_NODEID="0", SLURMD_NODENAME="node1")  # fmt: skip
    with pytest.raises(RuntimeEnvError) as err:
        check_allocation(derive(env), spec_of())
    assert "--nodes=2" in err.value.hint


def test_allocation_gpus_missing_or_wrong():
    spec = spec_of("nodes = 2\ngpus_per_node = 2")
    with pytest.raises(RuntimeEnvError) as err:
        check_allocation(derive(slurm_env()), spec)
    assert "--gpus-per-node=2" in err.value.hint
    with pytest.raises(RuntimeEnvError, match="sees 3 GPU"):
        check_allocation(derive(slurm_env(CUDA_VISIBLE_DEVICES="0,1,2")), spec)
    check_allocation(derive(slurm_env(CUDA_VISIBLE_DEVICES="0,1")), spec)


def test_allocation_local_executor_runs_the_whole_world():
    check_allocation(derive(local_env(0, n=4)), spec_of())
    with pytest.raises(RuntimeEnvError, match="local executor started 2"):
        check_allocation(derive(local_env(0, n=2)), spec_of())


# ---------------------------------------------------------------- child_env


def test_child_env_order():
    base = {"PATH": "/bin", "RANK": "99", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "DEEPSPEED_TIMEOUT": "5", "KEEP": "me"}
    spec_env = {"DEEPSPEED_TIMEOUT": "60", "NCCL_DEBUG": "INFO", "MASTER_PORT": "29400"}
    out = child_env(base, derive(slurm_env()), spec_env, log_dir="/o/logs")
    assert out["KEEP"] == "me" and out["PATH"] == "/bin"  # base env passes through
    assert out["RANK"] == "3"  # derived beats base
    assert out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # defaults beat base
    assert out["DEEPSPEED_TIMEOUT"] == "60" and out["NCCL_DEBUG"] == "INFO"  # user [env] beats all
    assert out["MASTER_PORT"] == "29400"
    assert out["TORCH_FR_DUMP_TEMP_FILE"] == "/o/logs/nccl_trace_rank_"
    assert base["RANK"] == "99"  # read never writes


def test_child_env_refuses_per_rank_vars_in_spec():
    with pytest.raises(RuntimeEnvError) as err:
        child_env({}, derive(slurm_env()), {"RANK": "0", "WORLD_SIZE": "8"})
    assert "RANK" in err.value.what and "WORLD_SIZE" in err.value.what
