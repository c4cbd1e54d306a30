"""Online RL (train.task = "grpo") through TRL's GRPOTrainer.

Fast: the spec refusals and the prompt-data checks of `swiftslurm validate` (file and line named), the reward
functions (built-ins, the guard that names a failing function and sample), the vLLM refusal where vLLM is absent.
Slow (the tiny model, real TRL/DeepSpeed on CPU):
  slurm   the shipped example on the test cluster, 2 nodes x 1 rank: a user reward in a file next to the spec is
          called on both nodes, the length reward is learned (the mean reward of the last steps beats the first),
          TRL's metrics reach metrics.jsonl, the checkpoints verify
  raising a user reward that raises on rank 1 at step 3: both ranks exit 70, rank 0 names the function and sample
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import quickstart_spec, submit_on_two_nodes

from swiftslurm.train.tasks import rewards

ROOT = Path(__file__).resolve().parents[1]
GRPO_EXAMPLE = ROOT / "examples" / "grpo_lora.toml"


def example_spec(tmp: Path, name: str, **train) -> tuple[str, Path]:
    return quickstart_spec(tmp, name, example=GRPO_EXAMPLE, **train)


def validate(spec: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", "validate", spec], capture_output=True, text=True,
                          timeout=120)


def flat(r: subprocess.CompletedProcess) -> str:
    return " ".join((r.stdout + r.stderr).split())


def refusal(spec: str) -> str:
    """What `validate` refuses in ``spec`` (its checks in-process: ``prepare``), as one line."""
    from swiftslurm.errors import SwiftSlurmError
    from swiftslurm.jobs.prepare import prepare

    with pytest.raises(SwiftSlurmError) as err:
        prepare(spec)
    assert err.value.exit_code == 2
    return " ".join(err.value.message().split())


# ---------------------------------------------------------------- fast: refusals


@pytest.mark.parametrize("train, expected", [
    ({"reward_funcs": ["lenght"], "reward_weights": [1.0]}, ["'lenght' is not a built-in", "did you mean 'length'"]),
    ({"reward_funcs": ["accuracy"], "reward_weights": [1.0]}, ["reward_length_target is set but reward_funcs has no 'length'"]),
    ({"reward_funcs": ["format"], "reward_weights": [1.0], "reward_length_target": None},
     ["the built-in reward 'format' needs train.reward_format_regex"]),
    ({"reward_weights": [1.0]}, ["reward_weights has 1 entries for 2 reward_funcs"]),
    ({"num_generations": 3}, ["num_generations (3) must divide the generation batch", "= 8 completions", "num_generations = 8"]),
    ({"max_completion_length": 96}, ["max_completion_length (96) must be below max_length (96)"]),
    ({"task": "sft"}, ["set with task = 'sft': these keys configure online RL only"]),
    ({"dpo_beta": 0.5}, ["dpo_beta set with task = \"grpo\""]),
])
def test_spec_refuses_what_cannot_work_with_the_reason(tmp_path, train, expected):
    spec, _ = example_spec(tmp_path, "bad", **{k: v for k, v in train.items() if v is not None})
    if train.get("reward_length_target", 0) is None:
        Path(spec).write_text(Path(spec).read_text().replace("reward_length_target = 8\n", ""))
    said = refusal(spec)
    for piece in expected:
        assert piece in said, said


@pytest.mark.parametrize("records, where, what", [
    (['{"prompt": "a", "solution": "1"}', '{"solution": "2"}'], "line 2", "missing 'prompt' (or 'messages')"),
    (['{"prompt": "a"}'], "line 1", "missing the column 'solution'"),
    (['{"prompt": "a", "solution": "1"}', '{"prompt": "b", "solution": "2", "level": 3}'], "line 2",
     "the columns ['level', 'solution'] differ"),
    (['{"messages": [{"role": "assistant", "content": "x"}], "solution": "1"}'], "line 1", "only assistant turns"),
    (['{"prompt": "a", "solution": "1", "completions": 3}'], "line 1", "column 'completions' has the name"),
])
def test_wrong_columns_are_refused_at_validate_naming_file_and_line(tmp_path, records, where, what):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(records) + "\n")
    spec, _ = example_spec(tmp_path, "bad")
    Path(spec).write_text(Path(spec).read_text().replace(str(ROOT / "examples/data/grpo_demo.jsonl"), str(data)))
    said = refusal(spec)
    assert f"{data}, {where}: " in said and what in said, said


def test_a_reward_file_next_to_the_spec_is_found_and_a_missing_one_refused(tmp_path):
    spec, _ = example_spec(tmp_path, "files", reward_funcs=["length", "mine.py:score"])
    r = validate(spec)  # the command itself, once: exit 2, the message, no traceback
    assert r.returncode == 2 and "the reward function's file does not exist" in flat(r) and str(tmp_path / "mine.py") in flat(r)
    assert "Traceback" not in r.stderr
    (tmp_path / "mine.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    assert validate(spec).returncode == 0


@pytest.mark.parametrize("source, said", [
    ("def scores(prompts, completions, **kw):\n    return []\n", "mine.py: its top-level functions: scores; did you mean 'scores'"),
    ("def score(prompts, completions:\n    return []\n", "has a syntax error; found"),
    ("score = 0.5\n", "'score' in the reward function's file is not a function; found"),
    ("async def score(prompts, completions, **kw):\n    return []\n", "is a coroutine (async def)"),
])
def test_a_reward_file_that_cannot_give_the_function_is_refused_without_running_it(tmp_path, source, said):
    """The file is parsed, never imported: a planted side effect at its top level does not run at validate."""
    marker = tmp_path / "RAN"
    (tmp_path / "mine.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + source)
    spec, _ = example_spec(tmp_path, "files", reward_funcs=["length", "mine.py:score"])
    r = validate(spec)
    assert r.returncode == 2 and said in flat(r) and "train.reward_funcs[1]" in flat(r), flat(r)
    assert not marker.exists() and "Traceback" not in r.stderr
    for fine in ("from helpers import score\n", "score = make_scorer(2)\n", "score = lambda prompts, completions, **kw: []\n"):
        (tmp_path / "mine.py").write_text(fine)  # what only running it could judge passes: the rank says more
        assert validate(spec).returncode == 0


def test_plan_counts_the_generation_cache_and_for_full_fine_tuning_with_kl_the_reference(tmp_path):
    from swiftslurm.plan import make_plan
    from swiftslurm.spec import parse_toml, validate_spec

    def parts(**train) -> dict[str, float]:
        spec, _ = example_spec(tmp_path, "m", model="org/some-7b", **train)
        raw = parse_toml(Path(spec).read_text() + SHAPE_7B)
        plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path))
        return plan.sizing[0].memory.to_json()["per_rank_gib"]

    lora, full = parts(), parts(train_type="full", deepspeed="zero3", bf16=True)
    kv = 2 * 4 * 32 * 4096 * (4 * 1) * 96 / 2**30  # k and v, fp32, 32 layers, kv width 4096, 4 sequences of 96 tokens
    assert lora["generation_kv_cache"] == pytest.approx(kv, abs=0.01) and "reference_model" not in lora
    assert full["reference_model"] == pytest.approx(2 * 6.6e9 / 2 / 2**30, rel=0.1)  # bf16 weights over 2 ZeRO-3 ranks


SHAPE_7B = """
[train.model_shape]
hidden_size = 4096
num_layers = 32
heads = 32
kv_heads = 32
intermediate_size = 11008
vocab_size = 32000
tie_word_embeddings = false
"""


def test_the_generation_keys_reach_trls_config(tmp_path):
    from swiftslurm.spec import load_spec
    from swiftslurm.train.tasks.grpo import grpo_arguments

    spec, _ = example_spec(tmp_path, "args", temperature=0.7, grpo_beta=0.2, per_device_train_batch_size=2,
                           num_generations=2, max_completion_length=16, reward_weights=[1.0, 0.5])
    args = grpo_arguments(load_spec(spec), str(tmp_path / "out"), {}, cuda=False)
    assert (args.temperature, args.beta, args.num_generations, args.max_completion_length, args.reward_weights) == \
        (0.7, 0.2, 2, 16, [1.0, 0.5])
    assert not args.use_vllm and not args.log_completions


def test_vllm_is_refused_where_it_is_absent():
    from swiftslurm.train.tasks.grpo import GenerationUnavailable, check_vllm

    check_vllm(False, cuda=False)  # the default: the model generates on each rank
    with pytest.raises(GenerationUnavailable, match="needs vLLM on the nodes") as err:
        check_vllm(True, cuda=True)  # vLLM is not installed here (and must not be)
    assert err.value.exit_code == 2 and "use_vllm = false" in err.value.hint


# ---------------------------------------------------------------- fast: the reward functions


def test_builtin_rewards_score_as_documented():
    length = rewards.length_reward(4)
    assert length(["p"] * 3, ["", "", ""], completion_ids=[[1] * 4, [1] * 2, [1] * 9]) == [1.0, 0.5, 0.0]
    fmt = rewards.format_reward(r"<a>\d+</a>")
    assert fmt(["p", "p"], [" <a>12</a>\n", "<a>x</a>"]) == [1.0, 0.0]
    got = rewards.accuracy(["p"] * 4, ["The answer is 12.", "112", [{"role": "assistant", "content": "12"}], "12 no"],
                           solution=["12", "12", "12", "12"])
    assert got == [1.0, 0.0, 1.0, 0.0]


def test_a_raising_reward_is_recorded_with_function_and_sample_and_answers_nan():
    def picky(prompts, completions, **kw):
        if any("bad" in c for c in completions):
            raise ValueError("cannot parse")
        return [1.0] * len(prompts)

    failures: list = []
    (guarded,) = rewards.guard([("picky.py:picky", picky)], rank=1, failures=failures)
    assert guarded(["q0", "q1"], ["fine", "ok"]) == [1.0, 1.0] and not failures
    out = guarded(["q0", "q1", "q2"], ["fine", "ok", "a bad one"])
    assert all(math.isnan(v) for v in out)
    (failure,) = failures
    assert failure.sample == "sample 2: prompt 'q2', completion 'a bad one'" and failure.rank == 1
    assert rewards.agree_on_failure(failures, "cpu") == failure  # one process: its own verdict
    error = rewards.failed_error(failure)
    assert error.exit_code == 70 and "reward function 'picky.py:picky' raised on rank 1: ValueError: cannot parse" in error.what


def test_a_reward_that_is_no_number_fails_the_agreed_way_not_out_of_the_guard():
    failures: list = []
    (guarded,) = rewards.guard([("words.py:words", lambda prompts, completions, **kw: ["good"] * len(prompts))], 0, failures)
    assert all(math.isnan(v) for v in guarded(["q0"], ["c0"]))
    (failure,) = failures
    assert "returned str 'good', not a number" in failure.error and failure.sample.startswith("sample 0:")


@pytest.mark.parametrize("returned,said", [
    (lambda n: [1.0] * (n - 1), "returned 2 rewards for 3 completions"),
    (lambda n: [1.0] * (n + 2), "returned 5 rewards for 3 completions"),
    (lambda n: 1.0, "TypeError"),  # one number for the batch: not a list of them
])
def test_a_reward_of_the_wrong_count_fails_the_agreed_way_naming_both_counts(returned, said):
    """TRL would pair rewards with the wrong completions (or fail inside its own sum on one rank): every rank must see
    the same failure instead, with the counts named."""
    failures: list = []
    (guarded,) = rewards.guard([("count.py:count", lambda prompts, completions, **kw: returned(len(prompts)))], 1, failures)
    out = guarded(["q0", "q1", "q2"], ["c0", "c1", "c2"])
    assert len(out) == 3 and all(math.isnan(v) for v in out)
    (failure,) = failures
    assert said in failure.error and failure.rank == 1
    assert rewards.failed_error(failure).exit_code == 70


def test_two_reward_files_of_one_name_are_two_functions_with_two_metric_names(tmp_path):
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "score.py").write_text(f"def score(prompts, completions, **kw):\n    return [{value}] * len(prompts)\n")
    names = [f"{tmp_path}/a/score.py:score", f"{tmp_path}/b/score.py:score"]
    train = type("Train", (), {"reward_funcs": names})()
    guarded = rewards.guard(rewards.resolve(train), 0, [])
    assert [g(["q"], ["c"]) for g in guarded] == [[1.0], [2.0]]  # before: a/score.py's function twice
    assert [g.__name__ for g in guarded] == ["a/score:score", "b/score:score"]


# ---------------------------------------------------------------- slow: real training


PROBE = '''
import os
from pathlib import Path


def probe(prompts, completions, completion_ids, solution, trainer_state, **kw):
    """Records each call (node, rank, completions, the step) next to this file; a neutral reward."""
    line = f"{os.environ.get('SLURMD_NODENAME', '-')} {os.environ.get('RANK')} {len(completions)} {trainer_state.global_step}\\n"
    with open(Path(__file__).with_name("calls.txt"), "a") as f:
        f.write(line)
    return [0.0] * len(completions)
'''

BOOM = '''
import os


def boom(prompts, completions, trainer_state, **kw):
    if os.environ.get("RANK") == "1" and trainer_state.global_step >= 2:
        raise KeyError("no score for " + completions[0][:10])
    return [0.0] * len(completions)
'''


@pytest.mark.slurm
@pytest.mark.slow
def test_grpo_learns_on_two_slurm_nodes_with_a_user_reward_and_verified_checkpoints(tmp_path, slurm_cluster):
    from swiftslurm import checkpoint as ck

    (tmp_path / "probe_reward.py").write_text(PROBE)
    spec, out = example_spec(tmp_path, "grpo2", reward_funcs=["length", "probe_reward.py:probe"], reward_weights=[1.0, 1.0],
                             max_steps=30, save_steps=15, logging_steps=1, learning_rate=3e-2)
    hosts = submit_on_two_nodes(spec, out, "grpo-2node-test", timeout_s=900)  # generation on CPU: slower than SFT
    assert len(set(hosts)) == 2, hosts
    for name in ("checkpoint-15", "checkpoint-30"):
        assert ck.verify(out / name).ok, ck.verify(out / name).problems
    calls = [line.split() for line in (tmp_path / "calls.txt").read_text().splitlines()]
    assert {c[0] for c in calls} == set(hosts) and {c[1] for c in calls} == {"0", "1"}, calls[:4]
    assert all(c[2] == "4" for c in calls) and len(calls) == 2 * 30  # 4 completions per rank and step
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 30
    for key in ("rewards/length/mean", "rewards/probe_reward:probe/mean", "completions/mean_length", "kl", "tokens_per_s"):
        assert all(key in r for r in steps), (key, sorted(steps[-1]))
    reward, length = [r["reward"] for r in steps], [r["completions/mean_length"] for r in steps]
    assert sum(reward[-10:]) / 10 > sum(reward[:10]) / 10 + 0.02, reward  # 0.04 -> 0.08 here: sampled, so noisy
    assert sum(length[-10:]) < sum(length[:10]), length  # toward the 8 tokens of reward_length_target
    assert "mean reward: first" in json.loads((out / "train-summary.json").read_text())["text"]


@pytest.mark.slow
def test_a_raising_reward_stops_every_rank_with_its_exit_code_naming_function_and_sample(tmp_path):
    from swiftslurm.train.launch import launch

    (tmp_path / "boom_reward.py").write_text(BOOM)
    spec, out = example_spec(tmp_path, "boom", reward_funcs=["length", "boom_reward.py:boom"], max_steps=6,
                             logging_steps=1)
    procs = launch(spec, str(out), nprocs=2, timeout_s=900)
    assert [p.returncode for p in procs] == [70, 70], [p.stdout[-3000:] for p in procs]
    said = " ".join(procs[0].stdout.split())
    assert "reward function" in said and "boom_reward.py:boom' raised on rank 1: KeyError: 'no score for" in said, said[-3000:]
    assert "found: sample 0: prompt 'What is" in said, said[-3000:]
    assert "Traceback" not in procs[0].stdout, procs[0].stdout[-3000:]


@pytest.mark.slow
def test_grpo_resumed_from_its_step_2_checkpoint_continues_with_the_uninterrupted_runs_losses_rewards_and_completions(tmp_path):
    """A start from the uninterrupted run's step-2 checkpoint (what a requeue after a walltime stop does; the stop
    itself is task-neutral: test_train, test_resume): steps 3-4 must be the uninterrupted run's, loss, reward and
    completion length alike. Sampled completions repeat only if every rank's RNG state came back with the checkpoint."""
    from test_train import run

    keys = {"max_steps": 4, "logging_steps": 1, "max_completion_length": 12}
    spec, ref = example_spec(tmp_path, "ref", save_steps=2, **keys)
    run(spec, ref)
    spec2, out = example_spec(tmp_path, "resumed", save_steps=100, **keys)
    second = run(spec2, out, resume=str(ref / "checkpoint-2"))
    assert second[0]["global_step"] == 4 and "resumes from" in second[0]["stdout"]

    def steps(d: Path) -> dict[int, tuple]:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["reward"], r["completions/mean_length"]) for r in rows if "reward" in r}

    want, got = steps(ref), steps(out)
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [3, 4], (want, got)
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got[step], want[step])
