"""Stragglers (issue 35): the pure decision, the doctor rule, the ledger's "slow" mark that never excludes, and one
real 2-node run on the Slurm cluster where rank 1 sleeps inside every step (SWIFTSLURM_TEST_SLOW_RANK) and is named
in metrics.jsonl, rank 0's log, `doctor` and the ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for_job
from hypothesis import given
from hypothesis import strategies as st
from runs import ONE_RANK_A_NODE, QUIET, tiny_spec

from swiftslurm.doctor.evidence import TaskRun
from swiftslurm.doctor.rules.slowrules import straggler
from swiftslurm.ledger import Entry, avoid, recent
from swiftslurm.train.health.straggler import StragglerState, decide, ratios

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"


def test_ratios_compare_each_rank_with_the_median_of_the_others():
    # two ranks: the slow one is 3x the other (the median of all would be their mean, capping any ratio below 2)
    assert ratios([0.3, 0.1]) == pytest.approx([3.0, 1 / 3])
    assert ratios([0.1, 0.1, 0.1, 0.5]) == pytest.approx([1.0, 1.0, 1.0, 5.0])
    assert ratios([0.2]) == [1.0]  # one rank: no one to compare with
    assert ratios([0.0, 0.0]) == [1.0, 1.0]


@given(st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=0, max_size=40))
def test_one_sort_gives_each_rank_the_median_of_all_the_others(times):
    import statistics

    def by_definition(rank: int) -> float:
        others = times[:rank] + times[rank + 1:]
        median = statistics.median(others) if others else 0.0
        return times[rank] / median if median > 0 else 1.0

    assert ratios(times) == pytest.approx([by_definition(r) for r in range(len(times))])


def test_a_rank_is_named_after_three_slow_windows_in_a_row_and_only_once():
    state = StragglerState()
    slow, fast = [0.1, 0.1, 0.3], [0.1, 0.1, 0.1]
    assert decide(state, slow, 1.5) == [] and decide(state, slow, 1.5) == []
    assert decide(state, fast, 1.5) == []  # a fast window starts the count again
    assert decide(state, slow, 1.5) == [] and decide(state, slow, 1.5) == []
    named = decide(state, slow, 1.5)
    assert [(n.rank, n.windows) for n in named] == [(2, 3)] and named[0].ratio == pytest.approx(3.0)
    assert decide(state, slow, 1.5) == []  # named once per run
    assert decide(StragglerState(), [0.1, 0.14], 1.5) == []  # under the factor: never


def test_doctor_names_the_straggler_with_node_and_ratio():
    rows = [(1, {"step": 4, "loss": 2.0}), (2, {"step": 4, "straggler_max_ratio": 3.1, "straggler_max_rank": 1}),
            (5, {"step": 12, "straggler_max_ratio": 3.2, "straggler_max_rank": 1, "straggler_rank": 1,
                 "straggler_node": "node2", "straggler_ratio": 3.2, "straggler_windows": 3}),
            (6, {"step": 13, "straggler_rank": "1", "straggler_node": "node9", "straggler_ratio": 9.0})]  # not ours: ignored
    (found,) = straggler(TaskRun(0, "/x", metrics=rows))
    assert found.code == "straggler" and found.nodes == ("node2",) and found.ranks == (1,)
    assert "3.20x" in found.what and found.evidence[0].line == 5
    assert straggler(TaskRun(0, "/x", metrics=rows[:2])) == []


def test_a_slow_mark_never_excludes_the_node():
    now = 1e6
    entries = [Entry("node2", "slow", "rank 1 3.2x", "7", now - 60), Entry("node3", "hang", "stuck", "8", now - 60)]
    bad = recent(entries, now, 24)
    assert list(bad) == ["node3"]
    assert avoid(bad, None, None, ["node1", "node2", "node3", "node4"], 2).excluded == ("node3",)


def straggler_spec(out: Path) -> str:
    return tiny_spec("straggler-test", out, data=DATA, slurm={**ONE_RANK_A_NODE, "nodes": 2, "time": "00:15:00"},
                     train={"max_steps": 20, "max_length": 128, "save_steps": 1000, "logging_steps": 10,
                            "straggler_window": 4, "straggler_factor": 2.0, "report_to": ["none"]},
                     **QUIET, env={"OMP_NUM_THREADS": "1", "SWIFTSLURM_TEST_SLOW_RANK": "1:0.3"})


@pytest.mark.slurm
def test_a_slowed_rank_is_named_everywhere(tmp_path, slurm_cluster):
    out = tmp_path / "run"
    spec = tmp_path / "straggler.toml"
    spec.write_text(straggler_spec(out))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sent = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", str(spec), "--executor", "slurm"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    job = json.loads((out / "submission.json").read_text())["submissions"][-1]["job_ids"][0]
    try:
        state = wait_for_job(job, timeout_s=1200)
    finally:
        subprocess.run(["scancel", "--name=straggler-test", job], capture_output=True, timeout=30)
    logs = "\n".join(p.read_text(errors="replace") for p in (out / "logs").rglob("*") if p.suffix in (".err", ".out", ".log"))
    assert state[job] == "COMPLETED", f"{state}\n{logs[-3000:]}"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    named = [r for r in rows if "straggler_rank" in r]
    # 3 windows of 4 steps: named at step 12, once; its node is where rank 1 ran (the second node of the allocation)
    assert [(r["straggler_rank"], r["step"]) for r in named] == [(1, 12)], named
    node = named[0]["straggler_node"]
    assert node in slurm_cluster and named[0]["straggler_ratio"] > 2.0
    assert f"straggler: rank 1 on {node}" in logs

    doctor = subprocess.run([sys.executable, "-m", "swiftslurm", "doctor", str(out), "--json"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    findings = [f for f in json.loads(doctor.stdout) if f["code"] == "straggler"]
    assert [(f["ranks"], f["nodes"]) for f in findings] == [([1], [node])], doctor.stdout + doctor.stderr

    ledger = json.loads(Path(os.environ["SWIFTSLURM_LEDGER"]).read_text())
    assert [(e["node"], e["reason"], e["job"]) for e in ledger] == [(node, "slow", job)]
