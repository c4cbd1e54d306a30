"""Checkpoint loads in a training rank never run code (checkpoint/formats/safeload.py): DeepSpeed's own
``torch.load(..., weights_only=False)`` reads through torch's weights-only unpickler while the trainer runs."""

from __future__ import annotations

import os

import pytest
import torch

from swiftslurm.checkpoint.formats.safeload import allowed_globals, weights_only_loads
from swiftslurm.errors import CheckpointDamaged


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_deepspeed_state_loads_and_a_payload_never_runs(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    good = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
                                         "state": {0: {"exp_avg": torch.ones(3)}}}, "ds_version": "0.19"}, good)
    marker = tmp_path / "PWNED"
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "ds_config": Payload(str(marker))}, bad)
    original = torch.load
    with weights_only_loads():
        # DeepSpeed's own call: weights_only=False is overridden, its classes are allowed
        state = torch.load(str(good), map_location="cpu", weights_only=False)
        assert isinstance(state["optimizer_state_dict"]["loss_scaler"], LossScaler)
        assert torch.equal(state["optimizer_state_dict"]["state"][0]["exp_avg"], torch.ones(3))
        with pytest.raises(CheckpointDamaged) as err:
            torch.load(str(bad), map_location="cpu", weights_only=False)
    assert torch.load is original  # restored on exit
    assert not marker.exists()
    assert "posix.system" in err.value.found and str(bad) in err.value.found


def test_only_classes_of_deepspeed_are_allowed():
    allowed, refused = allowed_globals(["deepspeed.runtime.fp16.loss_scaler.LossScaler", "posix.system",
                                        "deepspeed.comm.init_distributed", "collections.Counter", "deepspeed.nope.Gone"])
    assert [c.__name__ for c in allowed] == ["LossScaler"]
    assert refused == ["posix.system", "deepspeed.comm.init_distributed", "collections.Counter", "deepspeed.nope.Gone"]


def test_torch_load_is_restored_when_the_block_fails():
    original = torch.load
    with pytest.raises(RuntimeError):
        with weights_only_loads():
            raise RuntimeError("training failed")
    assert torch.load is original


def test_the_universal_converter_never_runs_a_planted_payload(tmp_path):
    """DeepSpeed's ds_to_universal (what a resume on another world size runs) reads every shard with
    weights_only=False in its own process; run as ds_convert, a payload in a shard refuses the conversion and never
    runs (with deepspeed.checkpoint.ds_to_universal in its place, the marker is made)."""
    import subprocess

    from swiftslurm.checkpoint.formats.universal import converter_argv

    step = tmp_path / "global_step1"
    step.mkdir()
    marker = tmp_path / "PWNED"
    torch.save({"module": {"w": torch.zeros(2)}, "ds_config": Payload(str(marker)), "dp_world_size": 1, "mp_world_size": 1},
               step / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 2}}, step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    argv = converter_argv(step, tmp_path / "out")
    assert argv[argv.index("-m") + 1] == "swiftslurm.checkpoint.formats.ds_convert"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode != 0 and "would run code when loaded" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()
