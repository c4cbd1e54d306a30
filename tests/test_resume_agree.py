"""Ranks agree on one resume point: rank 0 decides, every rank checks it can read it, one verdict.

Real ranks: two processes with a gloo process group run the trainer's agreement (train.resume), with a
stale listing on rank 1 (the test hook a shared filesystem's directory cache stands in for) and with rank 1
in its own mount namespace where the chosen checkpoint is hidden under an empty bind mount (a node whose
view of the output dir differs: a real fault for that rank alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint import make_checkpoint

from swiftslurm import checkpoint as ck
from swiftslurm.errors import CheckpointUnreadable
from swiftslurm.slurm.distenv import free_port

AGREE = """
import datetime, json, sys
import torch.distributed as tdist
from swiftslurm.errors import SwiftSlurmError
from swiftslurm.train.resume import agree as resume
out, rank = sys.argv[1], int(sys.argv[2])
tdist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
try:
    print("RESULT " + json.dumps({"path": resume.resolve(True, out, rank, f"node{rank + 1}")}), flush=True)
except SwiftSlurmError as exc:
    print("ERROR " + exc.message(), flush=True)
tdist.destroy_process_group()
"""


def two_ranks(out: Path, env: dict[str, str] | None = None, wrap_rank1: list[str] | None = None) -> list[str]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        argv = [sys.executable, "-c", AGREE, str(out), str(rank)]
        if rank == 1 and wrap_rank1:
            argv = [*wrap_rank1, *argv]
        penv = {**os.environ, **(env or {}), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(argv, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
        assert p.returncode == 0, text[-3000:]
        outs.append(next((line for line in text.splitlines() if line.startswith(("RESULT", "ERROR"))), text[-3000:]))
    return outs


@pytest.fixture
def three(tmp_path):
    out = tmp_path / "out"
    for step in (1, 2, 3):
        make_checkpoint(out, step)
    return out


def test_files_of_rank_keeps_shared_files_and_only_this_ranks_own():
    files = {f: {} for f in ("global_step3/mp_rank_00_model_states.pt", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "global_step3/zero_pp_rank_10_mp_rank_00_model_states.pt",
                             "rng_state_1.pth", "rng_state_11.pth", "scheduler.pt", "trainer_state.json")}
    assert ck.ranks.agree.files_of_rank(files, 1) == ["global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                                "global_step3/mp_rank_00_model_states.pt", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"]


def test_readable_problem_names_what_this_rank_cannot_read(three):
    newest = ck.final_dir(three, 3)
    assert ck.readable_problem(newest, 1) is None
    (newest / "rng_state_0.pth").write_bytes(b"x")  # another rank's file: not this rank's business
    assert ck.readable_problem(newest, 1) is None
    (newest / "rng_state_1.pth").unlink()
    assert ck.readable_problem(newest, 1) == "checkpoint-3/rng_state_1.pth: missing"
    assert "not a directory" in ck.readable_problem(three / "checkpoint-9", 1)
    (ck.final_dir(three, 2) / "manifest.json").write_text("{")
    assert "manifest.json: not valid JSON" in ck.readable_problem(ck.final_dir(three, 2), 1)


def test_a_single_rank_decides_alone_and_rank_0_failing_to_decide_is_an_error(three):
    assert ck.agree_resume_point(three, 0, "n1", ck.SingleRank(), lambda: ck.newest_verified(three, log=None), log=lambda _m: None) == ck.final_dir(three, 3)

    def cannot_list():
        raise PermissionError(13, "Permission denied", str(three))

    with pytest.raises(CheckpointUnreadable, match="rank 0 could not choose"):
        ck.agree_resume_point(three, 0, "n1", ck.SingleRank(), cannot_list)


def test_a_stale_listing_on_one_rank_does_not_make_ranks_diverge(three, monkeypatch):
    monkeypatch.setenv(ck.discover.STALE_LISTING_ENV, "1")
    monkeypatch.setenv("RANK", "1")  # the hook bites: rank 1 deciding alone would resume from checkpoint-2
    assert ck.newest_verified(three, log=None) == ck.final_dir(three, 2)
    outs = two_ranks(three, env={ck.discover.STALE_LISTING_ENV: "1"})
    assert outs == [f"RESULT {json.dumps({'path': str(ck.final_dir(three, 3))})}"] * 2, outs


def test_a_rank_that_cannot_see_the_chosen_checkpoint_stops_every_rank_naming_it(three, tmp_path):
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)  # util-linux; root (CI runs as root)
    if probe.returncode != 0:  # a failure under CI=true (tests/conftest.py)
        pytest.skip(f"no mount namespace for this user (unshare -m needs root): {probe.stderr.decode()[-200:]}")
    empty = tmp_path / "empty"
    empty.mkdir()
    hide = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"', str(empty), str(ck.final_dir(three, 3))]
    outs = two_ranks(three, wrap_rank1=hide)
    assert outs[0] == outs[1], outs  # one verdict, on every rank
    assert outs[0].startswith("ERROR rank 1 on node node2 cannot read the resume point checkpoint-3 that rank 0 chose"), outs
    assert "manifest.json: no manifest.json" in outs[0] and "check the mount on node2" in outs[0], outs
