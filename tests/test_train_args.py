"""train.max_grad_norm and train.ddp_timeout reach what enforces them: DeepSpeed's gradient clipping (through HF's
"auto" fill of the real preset) and the process-group timeouts (TrainingArguments, DEEPSPEED_TIMEOUT)."""

from __future__ import annotations

import pytest

from swiftslurm.dsconfig import load_preset
from swiftslurm.slurm.distenv import child_env, derive
from swiftslurm.spec import parse_toml, validate_spec

SPEC = """
[job]
name = "args"
[train]
model = "tiny-llama"
dataset = ["d.jsonl"]
{extra}
"""


def spec_of(extra: str = ""):
    return validate_spec(parse_toml(SPEC.format(extra=extra)))


@pytest.mark.parametrize("extra,clip,timeout", [("", 1.0, 1800), ("max_grad_norm = 0.5\nddp_timeout = 90", 0.5, 90)])
def test_clipping_and_timeout_reach_deepspeed_and_the_trainer(tmp_path, extra, clip, timeout):
    from swiftslurm.train.build import training_arguments

    args = training_arguments(spec_of(extra), str(tmp_path), load_preset("zero2"), cuda=False)
    assert args.max_grad_norm == clip and args.ddp_timeout == timeout
    assert args.hf_deepspeed_config.config["gradient_clipping"] == clip  # the preset's "auto", filled by HF from the spec


def test_ddp_timeout_sets_deepspeeds_timeout_in_minutes_and_env_still_wins():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1", "SLURM_TASKS_PER_NODE": "1"}
    dist = derive(env)
    assert child_env({}, dist, {}, pg_timeout_s=90)["DEEPSPEED_TIMEOUT"] == "2"  # rounded up: never shorter than asked
    assert child_env({}, dist, {}, pg_timeout_s=None)["DEEPSPEED_TIMEOUT"] == "30"
    assert child_env({}, dist, {"DEEPSPEED_TIMEOUT": "5"}, pg_timeout_s=90)["DEEPSPEED_TIMEOUT"] == "5"


def test_bad_values_are_spec_errors():
    from swiftslurm.errors import SpecError

    for extra in ("max_grad_norm = -1", "ddp_timeout = 0", "max_grad_norm = nan"):
        with pytest.raises(SpecError):
            spec_of(extra)


def test_a_nonfinite_loss_is_logged_as_the_mean_so_far_without_a_host_read():
    """HF's logging_nan_inf_filter reads each micro-batch's loss on the host; ours is off in TrainingArguments and
    the trainer applies the same rule on the device: the logged sum grows by the mean of the losses summed since
    the last log, exactly as the Trainer's loop adds it."""
    import torch

    from swiftslurm.train.build import training_arguments
    from swiftslurm.train.trainer import finite_or_mean

    assert training_arguments(spec_of(), "/tmp/unused", load_preset("zero2"), cuda=False).logging_nan_inf_filter is False
    summed = torch.tensor(6.0)  # three steps of 2.0 since the last log
    for bad in (float("nan"), float("inf"), -float("inf")):
        hf = summed + summed / (1 + 2)  # the loop's branch: _tr_loss += _tr_loss / (1 + global_step - last_logged)
        assert torch.equal(summed + finite_or_mean(torch.tensor(bad), summed, 2), hf)
    assert finite_or_mean(torch.tensor(1.5), summed, 2).item() == 1.5
