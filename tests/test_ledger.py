"""The node-health ledger (issue 14): a real file under concurrent writers, the exclusion decision, the
`nodes` command, and on the real cluster: a preflight fault on node3 is remembered and the next submit
lands without node3 (sacct's NodeList)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swiftslurm import ledger
from swiftslurm.errors import SwiftSlurmError
from swiftslurm.ledger import Entry, avoid, recent
from swiftslurm.slurm import parse_sinfo_nodes

HOUR = 3600.0


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


# ---------------------------------------------------------------- the file


def _writer(path: str, who: int, n: int) -> None:
    for i in range(n):
        ledger.record([Entry(f"node{who}", "hang", f"write {i}", f"{who}-{i}")], Path(path))


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "ledger.json"
    procs = [multiprocessing.get_context("fork").Process(target=_writer, args=(str(path), w, 15)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = ledger.read(path)
    assert len(entries) == 90 and len({(e.node, e.job) for e in entries}) == 90  # a lost update would drop some
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]  # every temporary file renamed into place


def test_record_dedupes_clear_forgets_and_a_torn_file_is_one_message(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "ledger.json"
    monkeypatch.setenv("SWIFTSLURM_LEDGER", str(path))
    assert ledger.ledger_path() == path and ledger.read() == []
    e = Entry("node3", "preflight", "ports node1->node3: refused", "41")
    assert len(ledger.record([e, e])) == 1 and ledger.record([e]) == []  # doctor run twice records once
    ledger.record([Entry("node2", "hang", "rank 1 never joined", "42")])
    assert [x.node for x in ledger.clear(["node3"])] == ["node3"] and [x.node for x in ledger.read()] == ["node2"]
    path.write_text('{"node": "oops"')
    with pytest.raises(SwiftSlurmError) as err:
        ledger.read()
    assert "--clear-all" in err.value.hint and str(path) in err.value.what
    proc = cli("nodes")
    assert proc.returncode == 1 and "cannot be read" in proc.stderr and "Traceback" not in proc.stderr
    assert cli("nodes", "--clear-all").returncode == 0 and ledger.read() == []


# ---------------------------------------------------------------- the decision (pure)


def bad(*names: str, now: float = 1e6, age_h: float = 1.0) -> dict[str, list[Entry]]:
    return recent([Entry(n, "preflight", "ports refused", "7", now - age_h * HOUR - i) for i, n in enumerate(names)], now, 24)


def test_entries_that_are_not_entries_are_left_out_and_said_never_the_whole_ledger(tmp_path, monkeypatch):
    """doctor once wrote ``gpu[07`` (a torn log line) into the ledger, which broke every plan for 24 h; a date of 1e300,
    a reason holding rich markup: each bad entry is left out and named, the good ones stay, the next write drops them."""
    path = tmp_path / "ledger.json"
    now = time.time()
    good = {"node": "node1", "reason": "hang[/]", "detail": "rank 1 [/] stopped", "job": "7", "when": now, "source": ""}
    bad = [{**good, "node": "gpu[07"}, {**good, "node": "node2", "when": 1e300}, {**good, "node": ["node3"]}, "node4"]
    path.write_text(json.dumps([good, *bad]))
    dropped: list[str] = []
    assert [e.node for e in ledger.read(path, dropped)] == ["node1"] and len(dropped) == 4, dropped
    assert "'gpu[07' is not a node name" in dropped[0] and "is not a time" in dropped[1]
    assert avoid(recent(ledger.read(path), now, 24), None, None, ["node1", "node2", "node3"], 1).excluded == ("node1",)
    env = {"SWIFTSLURM_LEDGER": str(path)}
    shown = cli("nodes", env=env)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stdout + shown.stderr
    assert "rank 1 [/] stopped" in shown.stdout and shown.stdout.count("left out") == 4, shown.stdout
    assert json.loads(cli("nodes", "--json", env=env).stdout)["dropped"] == dropped
    assert ledger.record([Entry("gpu[08", "hang", "torn", "8"), Entry("node5", "hang", "x", "8")], path)[0].node == "node5"
    assert [e["node"] for e in json.loads(path.read_text())] == ["node1", "node5"]  # the write dropped the bad ones


def test_avoid_merges_with_the_users_exclude():
    d = avoid(bad("node3"), "node1", None, ["node1", "node2", "node3", "node4"], 2)
    assert d.excluded == ("node3",) and d.exclude == "node[1,3]" and "excluding node3" in d.notes[0]
    assert avoid(bad("node1"), "node1", None, None, 1).excluded == ()  # already excluded by the user: nothing to add


def test_avoid_never_makes_the_job_unsatisfiable():
    nodes = ["node1", "node2", "node3", "node4"]
    d = avoid(bad("node3"), None, None, nodes, 4)
    assert d.excluded == () and d.exclude is None and d.kept == ("node3",)
    assert "needs 4" in d.notes[0] and "unsatisfiable" in d.notes[0]
    d = avoid(bad("node3", "node4"), None, None, nodes, 3)  # room for one: the most recent failure goes
    assert d.excluded == ("node3",) and d.kept == ("node4",)
    d = avoid(bad("node2"), None, "node[1-2]", nodes, 2)  # named by nodelist: never excluded
    assert d.excluded == () and "slurm.nodelist" in d.notes[0]
    d = avoid(bad("gpu7"), None, None, nodes, 2)  # another partition's node: no concern of this job
    assert d.excluded == () and d.notes == ()
    assert avoid(bad("node3"), None, None, None, 4).excluded == ("node3",)  # partition unknown: excluded


def test_old_entries_expire():
    assert recent([Entry("node3", "hang", "x", "1", 1e6 - 25 * HOUR)], 1e6, 24) == {}
    assert list(recent([Entry("node3", "hang", "x", "1", 1e6 - 23 * HOUR)], 1e6, 24)) == ["node3"]


def test_sinfo_usable_nodes_of_a_partition():
    text = ("node1|debug*|mix\nnode2|debug*|drain\nnode3|debug*|idle~\nnode4|debug*|alloc\nnode5|debug*|idle*\n"
            "node6|debug*|down*\ngpu1|gpu|down\ngpu2|gpu|idle\n")
    assert parse_sinfo_nodes(text, None) == ["node1", "node3", "node4"]  # powered down (~) boots for a job; * = not responding
    assert parse_sinfo_nodes(text, "gpu") == ["gpu2"] and parse_sinfo_nodes(text, "nope") == []


# ---------------------------------------------------------------- swiftslurm nodes


def test_nodes_command_lists_and_clears(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    monkeypatch.setenv("SWIFTSLURM_LEDGER", str(path))
    proc = cli("nodes")
    assert proc.returncode == 0 and "is empty" in proc.stdout
    ledger.record([Entry("node3", "preflight", "ports node2->node3: connection refused", "41"),
                   Entry("node2", "hang", "rank 1 (node2) never joined", "42")])
    proc = cli("nodes")
    assert proc.returncode == 0 and "node3" in proc.stdout and "connection refused" in proc.stdout and "--clear NODE" in proc.stdout
    data = json.loads(cli("nodes", "--json").stdout)
    assert data["ledger"] == str(path) and sorted(e["node"] for e in data["entries"]) == ["node2", "node3"]
    proc = cli("nodes", "--clear", "node9")
    assert proc.returncode == 1 and "no entry for node9" in proc.stderr and "node2, node3" in proc.stderr
    assert cli("nodes", "--clear", "node3").returncode == 0 and [e.node for e in ledger.read(path)] == ["node2"]
    assert cli("nodes", "--clear-all").returncode == 0 and ledger.read(path) == []


# ---------------------------------------------------------------- on the cluster

SPEC = """
[job]
name = "ledger-{name}"
output_dir = "{out}"
[slurm]
partition = "debug"
nodes = {nodes}
time = "00:04:00"
{slurm_extra}
[train]
command = ["hostname"]
[preflight]
checks = {checks}
timeout_s = 30
[env]
SWIFTSLURM_PREFLIGHT_FAULT = "no-listener@node3"
"""


def submit(tmp_path: Path, name: str, nodes: int, checks: str, slurm_extra: str = "") -> dict:
    spec = tmp_path / f"{name}.toml"
    spec.write_text(SPEC.format(name=name, out=tmp_path / name, nodes=nodes, checks=checks, slurm_extra=slurm_extra))
    proc = cli("submit", str(spec), "--executor", "slurm", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def wait_final(sub: dict, since: str, timeout_s: float = 240) -> tuple[str, str]:
    """(state, NodeList) of a submitted job once it ended; by name and submit time too: a reset cluster reuses job ids."""
    from conftest import FINAL_STATES

    argv = ["sacct", "-X", "-n", "-P", "-j", sub["job_ids"][0], "-S", since, "--name", sub["job_name"], "--format=State,NodeList"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = [ln.split("|") for ln in subprocess.run(argv, capture_output=True, text=True).stdout.splitlines() if ln.strip()]
        if rows and rows[-1][0].split()[0] in FINAL_STATES:
            return rows[-1][0].split()[0], rows[-1][1]
        time.sleep(2)
    subprocess.run(["scancel", sub["job_ids"][0]], capture_output=True)
    raise AssertionError(f"job {sub['job_ids'][0]} did not end in {timeout_s} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_preflight_fault_on_node3_is_remembered_and_the_next_submit_avoids_it(tmp_path):
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    first = submit(tmp_path, "faulty", 3, '["ports"]', 'nodelist = "node[2-4]"')
    state, nodelist = wait_final(first, since)
    assert state == "FAILED" and nodelist == "node[2-4]", (state, nodelist)
    entries = ledger.read()
    assert [(e.node, e.reason, e.job) for e in entries] == [("node3", "preflight", first["job_ids"][0])], entries
    assert "ports" in entries[0].detail and entries[0].source == str(tmp_path / "faulty")

    second = submit(tmp_path, "next", 3, "[]")  # 3 of 4 nodes: Slurm's first pick would be node[1-3]
    assert second["avoided"][0]["excluded"] == ["node3"] and second["avoided"][0]["exclude"] == "node3"
    spec = json.loads((tmp_path / "next" / "spec.json").read_text())
    assert spec["spec"]["slurm"]["exclude"] == "node3"  # what was sent is what the task's spec says
    state, nodelist = wait_final(second, since)
    assert state == "COMPLETED" and "node3" not in nodelist and nodelist == "node[1-2,4]", (state, nodelist)

    spec = tmp_path / "whole.toml"  # all 4 nodes: excluding node3 would leave the job unsatisfiable; the panel says so
    spec.write_text(SPEC.format(name="whole", out=tmp_path / "whole", nodes=4, checks="[]", slurm_extra=""))
    proc = cli("submit", str(spec), "--executor", "slurm")
    job = re.search(r"job (\d+)", proc.stdout)
    if job:
        subprocess.run(["scancel", job.group(1)], capture_output=True)
    assert proc.returncode == 0 and job, proc.stdout + proc.stderr
    flat = " ".join(proc.stdout.split()).replace("│", "")
    assert "not excluding node3" in flat and "needs 4" in flat, proc.stdout


def test_preflight_records_only_the_blamed_nodes_of_a_slurm_job():
    from types import SimpleNamespace

    from swiftslurm.preflight.gate import ledger_entries
    from swiftslurm.preflight.results import CheckResult

    dist = SimpleNamespace(executor="slurm", nodes=("node2", "node3", "node4"), requeue_id="5")
    bad = [CheckResult("ports", "node2->node3", False, "connection refused"), CheckResult("ports", "node4->node3", False, "connection refused"),
           CheckResult("ports", "node2->node4", True, "open")]
    found = ledger_entries(bad, dist, "/out")
    assert [(e.node, e.reason, e.job, e.source) for e in found] == [("node3", "preflight", "5", "/out")] and "refused" in found[0].detail
    everyone = [CheckResult("ports", f"{a}->{b}", False, "refused") for a in dist.nodes for b in dist.nodes if a != b]
    assert ledger_entries(everyone, dist, "/out") == []  # no node to blame: a firewall, not a node
    assert ledger_entries(bad, SimpleNamespace(executor="local", nodes=dist.nodes, requeue_id="local-1"), "/out") == []
    taken = [CheckResult("ports", "node2", False, "MASTER_PORT 16816 is busy on node2", data={"port_taken": 16816})]
    assert ledger_entries(taken, dist, "/out") == []  # this job's derived port, not the node's health


def test_the_preflight_store_port_held_by_another_process_is_the_jobs_port_not_the_node(tmp_path):
    """Rank 0 cannot host the preflight store because some other process listens on the job's port: the result says
    so (the port, the fix) and is marked so that the ledger does not blame the node."""
    import socket

    from swiftslurm.preflight.gate import ledger_entries
    from swiftslurm.preflight.run import run_checks
    from swiftslurm.slurm import distenv
    from swiftslurm.spec import parse_spec

    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("", 0))
    squatter.listen(1)
    store_port = squatter.getsockname()[1]
    try:
        dist = distenv.derive({}, pid=4242, explicit={"MASTER_PORT": str(store_port - 1)})
        spec = parse_spec(f'[job]\nname = "p"\noutput_dir = "{tmp_path}"\n[preflight]\nchecks = ["disk"]\ntimeout_s = 5\n')
        outcome = run_checks(dist, spec, str(tmp_path), ["disk"], env={})
    finally:
        squatter.close()
    (result,) = outcome.results
    assert result.check == "coordination" and not result.ok and result.data == {"port_taken": store_port}
    assert f"port {store_port} is taken on" in result.hint and "resubmit" in result.hint
    assert ledger_entries(outcome.results, dataclasses.replace(dist, executor="slurm"), str(tmp_path)) == []


def test_each_allocation_of_a_sweep_gets_its_own_decision(tmp_path):
    from swiftslurm.ledger import avoid_in_plan
    from swiftslurm.plan import make_plan
    from swiftslurm.slurm.render import sbatch_directives
    from swiftslurm.spec import parse_toml, validate_spec

    raw = parse_toml(f"""
[job]
name = "sweep"
output_dir = "{tmp_path}/out"
[slurm]
exclude = "node1"
[train]
command = ["true"]
[sweep]
"slurm.nodes" = [2, 3]
""")
    plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path))
    entries = [Entry("node3", "hang", "rank 2 never joined", "9", time.time() - 60)]
    new, decisions = avoid_in_plan(plan, entries, lambda partition: ["node1", "node2", "node3", "node4"])
    by_group = {g: d for g, d in decisions}
    small = [g for g in new.groups if g.slurm.nodes == 2][0]
    big = [g for g in new.groups if g.slurm.nodes == 3][0]
    assert small.slurm.exclude == "node[1,3]" and by_group[small.index].excluded == ("node3",)
    assert big.slurm.exclude == "node1" and by_group[big.index].kept == ("node3",)  # 3 of the 3 left: node3 must stay
    assert ("exclude", "node[1,3]") in sbatch_directives(new, small) and ("exclude", "node1") in sbatch_directives(new, big)  # what is sent
    off = {**raw, "slurm": {**raw["slurm"], "avoid_bad_nodes": False}}
    assert avoid_in_plan(make_plan(validate_spec(off), off, base_dir=str(tmp_path)), entries, lambda p: None)[1] == []


@pytest.mark.slurm
def test_a_torn_ledger_refuses_the_submission_with_one_message(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    path.write_text("[{\"node\": \"node3\"")
    monkeypatch.setenv("SWIFTSLURM_LEDGER", str(path))
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC.format(name="torn", out=tmp_path / "torn", nodes=1, checks="[]", slurm_extra=""))
    proc = cli("submit", str(spec), "--executor", "slurm")
    assert proc.returncode == 3 and "cannot be read" in proc.stderr and "--clear-all" in proc.stderr, proc.stderr
    assert "avoid_bad_nodes = false" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "torn" / "swiftslurm-plan.json").exists()  # nothing was sent


@pytest.mark.slurm
def test_plan_shows_the_exclusion_submit_would_make(tmp_path, monkeypatch):
    """`plan` sends nothing but shows what `submit` would do now: the ledger's node3 in the script's --exclude, and why."""
    path = tmp_path / "ledger.json"
    monkeypatch.setenv("SWIFTSLURM_LEDGER", str(path))
    ledger.record([Entry("node3", "preflight", "ports node2->node3: connection refused", "41")])
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC.format(name="plan", out=tmp_path / "plan", nodes=2, checks="[]", slurm_extra='exclude = "node1"'))
    data = json.loads(cli("plan", str(spec), "--json").stdout)
    assert [(a["excluded"], a["exclude"]) for a in data["avoided"]] == [(["node3"], "node[1,3]")]
    assert "#SBATCH --exclude='node[1,3]'" in data["sbatch"], data["sbatch"]
    shown = cli("plan", str(spec)).stdout
    assert "bad nodes:" in shown and "excluding node3 (recently failed: node3: preflight in job 41" in shown, shown
    assert not (tmp_path / "plan").exists()  # nothing written, nothing sent
    # a preflight-only spec is how a node gets tested again: never avoided
    spec.write_text(SPEC.format(name="plan", out=tmp_path / "plan", nodes=2, checks="[]", slurm_extra="").replace('[train]\ncommand = ["hostname"]\n', ""))
    assert json.loads(cli("plan", str(spec), "--json").stdout)["avoided"] == []
