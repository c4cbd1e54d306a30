"""Continued pretraining on raw text (train.task = "pt").

Fast: how a document becomes samples (every token a label, EOS at its end, a long one cut into max_length
pieces), the token cache's own key for pt, the rows packed from them, `validate` naming the file and line of a
record without a string `text`, and pt as SFT's trainer in the spec rules and `plan`'s sizing.
Slurm (2 nodes x 1 CPU rank, tiny-llama, ZeRO-2, test_resume's spec): a run sent the walltime signal, requeued
and resumed, against an uninterrupted one: every loss bitwise equal, the checkpoints verified, pt and packing on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swiftslurm.train.data import cache as datacache
from swiftslurm.train.data import text
from swiftslurm.train.data.records import DataError
from swiftslurm.train.tinymodel import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pt.toml"
DEMO = ROOT / "examples" / "data" / "pt_demo.jsonl"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_a_document_is_labelled_everywhere_ends_with_eos_and_a_long_one_is_cut_into_pieces(tok):
    short, long_text = "The cat is red.", "x" * 300
    out = text.encode_many([("text", short), ("text", long_text), ("text", "")], tok, 128)
    ids = tok(short)["input_ids"] + [tok.eos_token_id]
    assert out[0] == {"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)}
    whole = tok(long_text)["input_ids"] + [tok.eos_token_id]
    assert [len(p["input_ids"]) for p in out[1:4]] == [128, 128, len(whole) - 256]  # nothing of the text is lost
    assert sum((p["input_ids"] for p in out[1:4]), []) == whole and all(p["labels"] == p["input_ids"] for p in out[1:4])
    assert out[4:] == [None]  # "" is just EOS here (this tokenizer adds no BOS): nothing to predict, counted as dropped


def test_pt_tokens_have_their_own_cache_and_pack_into_full_rows(tmp_path, tok):
    """A record that is both an alpaca record and a text record: SFT and pt tokens of the same file must not share a
    cache directory (the key holds the task)."""
    from swiftslurm.train.data.packing import PackedDataset, pack_row

    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"instruction": "Say hi.", "output": "hi", "text": "Hello there, world."}) + "\n")
    sft = datacache.cached_dataset([str(both)], tok, 64, tmp_path / "cache")
    pt = datacache.cached_dataset([str(both)], tok, 64, tmp_path / "cache", task="pt")
    assert pt.tokenized_now and pt.directory != sft.directory
    assert tok.decode(pt[0]["input_ids"]) == "Hello there, world.</s>" and pt[0]["labels"] == pt[0]["input_ids"]

    demo = datacache.cached_dataset([str(DEMO)], tok, 128, tmp_path / "cache", task="pt")
    rows = PackedDataset(demo, 128, seed=42)
    assert rows.padding_ratio() < 0.15, rows.padding_ratio()  # 22 short documents: the last rows are the fullest left
    row = pack_row(rows[0], 128, tok.pad_token_id)
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]  # each document (and the padding) restarts at 0
    assert len(starts) >= min(2, len(rows[0])) and all(row["labels"][i] == -100 for i in starts)


@pytest.mark.parametrize("line2, what", [
    ('{"content": "no text field"}', "no 'text' field"),
    ('{"text": ["a", "list"]}', "'text' must be a string"),
])
def test_validate_refuses_a_record_without_a_string_text_naming_file_and_line(tmp_path, line2, what):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "fine"}\n' + line2 + "\n")
    spec = tmp_path / "pt.toml"
    spec.write_text(EXAMPLE.read_text().replace('"examples/data/pt_demo.jsonl"', json.dumps(str(data))))
    r = subprocess.run([sys.executable, "-m", "swiftslurm", "validate", str(spec)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and f"{data}, line 2: {what}" in said and "Traceback" not in said, said


def test_columnar_text_rows_are_named_by_row_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), good)
    assert text.scan([str(good)]) == 2
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a", None]}), bad)  # a null is an absent field
    with pytest.raises(DataError, match=r"bad.parquet, row index 1: no 'text' field"):
        text.scan([str(good), str(bad)])


def test_pt_is_sfts_trainer_in_the_spec_rules_and_the_sizing():
    from swiftslurm.sizing.check import size_task
    from swiftslurm.spec import parse_spec

    def spec(task: str, extra: str = "") -> str:
        return (f'[job]\nname = "t"\noutput_dir = "/tmp/t"\n[slurm]\nnodes = 1\ngpus_per_node = 2\n[train]\ntask = "{task}"\n'
                f'model = "tiny-llama"\ndataset = ["d.jsonl"]\ndeepspeed = "zero2"\n{extra}')

    with pytest.raises(Exception, match='dpo_beta set with task = "pt"'):
        parse_spec(spec("pt", "dpo_beta = 0.5\n"))
    parse_spec(spec("pt", 'bf16 = true\nattn_implementation = "varlen_attn"\n'))  # packed rows: the varlen kernel applies
    sp = "[parallel]\nsequence_parallel = 2\n"
    for task, refused in (("pt", False), ("dpo", True)):
        _, problems = size_task(parse_spec(spec(task, sp)), {"zero_optimization": {"stage": 2}}, read_disk=False)
        assert any("built for SFT" in p.what for p in problems) == refused, (task, problems)


def _signal_at_step(job: str, out: Path, step: int, timeout_s: float) -> None:
    """USR2 to every rank of ``job`` (what Slurm sends at ``--signal=USR2@grace``) once it has logged ``step``."""
    deadline = time.monotonic() + timeout_s
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(r).get("step", 0) >= step for r in rows if r.strip()):
            subprocess.run(["scancel", "--signal=USR2", job], check=True, capture_output=True, timeout=30)
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not reach step {step} in {timeout_s:.0f} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_pt_on_two_nodes_stopped_by_the_walltime_signal_requeues_to_the_losses_of_the_uninterrupted_run(tmp_path, slurm_cluster):
    """test_resume's spec (2 nodes x 1 rank, ZeRO-2, full fine-tuning) with task = "pt" on the demo text, twice side by
    side: uninterrupted, and sent Slurm's walltime signal (USR2 to every rank, as ``--signal=USR2@grace`` does) at
    step 10 or later. The signalled run saves, requeues itself, resumes on both nodes and must log every step's loss
    bitwise as the uninterrupted run did. The signal is sent by the test, not by Slurm's clock, so a loaded machine
    whose start-up outlasts a short time limit cannot turn the requeue into a TIMEOUT (test_resume covers the clock)."""
    from conftest import sacct_rows, wait_for_job
    from test_resume import explain, losses, submit

    from swiftslurm import checkpoint as ck

    steps, pt = 60, {"task": "pt"}
    ref_job, ref_out = submit(tmp_path, "pt-reference", "00:10:00", steps=steps, data=DEMO, train=pt)
    # every step at least 0.2 s (the watchdog's test hook; the losses do not change): the signal lands mid-run
    # and it saves in the background (checkpoint.async_save): rank 1 on the other node hands rank 0 its shards' hashes
    req_job, req_out = submit(tmp_path, "pt-requeued", "00:10:00", steps=steps, min_step_s=0.2, data=DEMO, train=pt,
                              checkpoint={"async_save": True})
    try:
        _signal_at_step(req_job, req_out, 10, timeout_s=600)
        ref_state = wait_for_job(ref_job, timeout_s=600)
        assert ref_state[ref_job] == "COMPLETED", f"reference {ref_state}\n{explain(ref_out)}"
        req_state = wait_for_job(req_job, timeout_s=600)
        assert req_state[req_job] == "COMPLETED", f"requeued {req_state}\n{explain(req_out)}"
    finally:  # never leave this test's jobs behind on the shared cluster (the name guards against reused ids)
        for job, name in ((ref_job, "resume-pt-reference"), (req_job, "resume-pt-requeued")):
            subprocess.run(["scancel", f"--name={name}", job], capture_output=True, timeout=30)

    (stop,) = json.loads((req_out / "requeues.json").read_text())
    assert stop["requeued"] and 10 <= stop["global_step"] < steps, stop
    runs = [state for (state,) in sacct_rows(req_job, "State", runs=True)]
    assert runs == ["REQUEUED", "COMPLETED"], runs
    ref, req = losses(ref_out), losses(req_out)
    assert sorted(ref) == sorted(req) == list(range(1, steps + 1)) and all(len(v) == 1 for v in ref.values())
    mismatched = {s: (ref[s][0], got) for s, got in req.items() if any(x != ref[s][0] for x in got)}
    assert not mismatched, f"{len(mismatched)} steps differ from the uninterrupted run, first: {sorted(mismatched.items())[:3]}"
    assert ref[steps][0] < 0.7 * ref[1][0], (ref[1], ref[steps])  # and it learns the text (5.6 -> 2.9 here)

    for out in (ref_out, req_out):
        summary = json.loads((out / "train-summary.json").read_text())
        assert summary["task"] == "pt" and summary["packing"] and summary["padding_ratio"] < 0.15, summary
        newest = ck.newest_verified(out, log=None)
        assert newest is not None and ck.read_manifest(newest).step == steps and ck.read_manifest(newest).meta["world_size"] == 2
        kept = [p for p in out.glob("checkpoint-*") if p.is_dir()]
        assert len(kept) == 2 and all(ck.verify(p).ok for p in kept), kept  # checkpoint.keep = 2, each re-hashed
    # the forced save at step 30 of the requeued run was written and committed in the background, across the two nodes,
    # and holds the bytes of the reference's synchronous one: DeepSpeed's shards and every rank's rng state
    rows = [json.loads(line) for line in (req_out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("checkpoint_step") == steps // 2 for r in rows), "no background commit of the forced save was logged"
    ours, theirs = (ck.read_manifest(out / f"checkpoint-{steps // 2}") for out in (req_out, ref_out))
    assert ours.meta["hashed_on_ranks"] == theirs.meta["hashed_on_ranks"] >= 2  # rank 1's rng state and optimizer shard
    shards = sorted(rel for rel in theirs.files if rel.endswith(".pt") or rel.endswith(".pth"))
    assert shards and all(ours.files[rel] == theirs.files[rel] for rel in shards), \
        [rel for rel in shards if ours.files.get(rel) != theirs.files[rel]]
