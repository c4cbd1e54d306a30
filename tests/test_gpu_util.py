"""GPU utilisation per rank into metrics.jsonl (NVML) and doctor's `low_gpu_util` on top of it.

The sampler's thread, its averaging and the per-rank reduction run for real; NVML itself cannot run here (no GPU):
`for_this_rank` must then give None (the fields absent, no error), which tests/test_train.py checks in a real run.
The doctor tests read the fixtures in tests/data/gpu_metrics, written in the trainer's format, NOT recorded on a GPU
(see their README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from swiftslurm.doctor import diagnose_task
from swiftslurm.doctor.evidence import read_task
from swiftslurm.train.health.gpuutil import UNKNOWN, GpuSampler, gpu_fields, nvml_key, rank_slots

FIXTURES = Path(__file__).parent / "data" / "gpu_metrics"


def test_nvml_finds_the_ranks_gpu_by_uuid_else_by_visible_index():
    assert nvml_key("5f1d-aa", "", 0) == ("uuid", "GPU-5f1d-aa")
    assert nvml_key("GPU-5f1d-aa", "3,7", 1) == ("uuid", "GPU-5f1d-aa")
    assert nvml_key(None, "3,7", 1) == ("index", 7)  # CUDA device 1 of "3,7" is NVML's GPU 7
    assert nvml_key(None, "GPU-aa,GPU-bb", 1) == ("uuid", "GPU-bb")
    assert nvml_key(None, "", 2) == ("index", 2)


def test_every_ranks_value_is_reduced_to_mean_lowest_and_whose():
    assert gpu_fields([UNKNOWN, UNKNOWN]) == {}  # no GPU anywhere: no field
    f = gpu_fields([0.9, 0.3, UNKNOWN, 0.6])
    assert abs(f["gpu_util"] - 0.6) < 1e-9 and f["gpu_util_min"] == 0.3 and f["gpu_util_min_rank"] == 1.0
    # the trainer's slots: each rank writes only its own slot of the summed vector (rank 1 sampled nothing)
    shares = [rank_slots(value, rank, 3) for rank, value in enumerate([0.8, None, 0.5])]
    summed = [sum(col) for col in zip(*shares, strict=True)]
    assert summed == [0.8, UNKNOWN, 0.5]
    assert gpu_fields(summed) == {"gpu_util": 0.65, "gpu_util_min": 0.5, "gpu_util_min_rank": 2.0}


def test_the_sampler_thread_averages_between_takes_and_stops():
    values = iter([100.0, 50.0, 0.0] + [20.0] * 10_000)
    sampler = GpuSampler(lambda: next(values), interval_s=0.01)
    sampler._thread.start()
    deadline = time.monotonic() + 10
    while sampler._count < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    first = sampler.take()
    assert first is not None and 0.2 <= first <= 0.5  # (100 + 50 + 0 + 20 ...) / n, as a fraction
    sampler.stop()
    assert not sampler._thread.is_alive()
    sampler.take()
    assert sampler.take() is None  # nothing sampled since: None, not 0


def test_without_a_gpu_nothing_is_sampled_and_nothing_fails():
    assert GpuSampler.for_this_rank() is None


def test_low_gpu_util_names_the_least_busy_rank_and_points_at_the_cause():
    found = diagnose_task(read_task(0, str(FIXTURES / "comm_bound")))
    assert [f.code for f in found] == ["low_gpu_util", "comm_bound"]
    low = found[0]
    assert "rank 5" in low.what and low.ranks == (5,) and "collectives (comm_bound below)" in low.cause
    assert low.evidence[0].file == "metrics.jsonl" and "gpu_util" in low.evidence[0].text
    found = diagnose_task(read_task(0, str(FIXTURES / "data_bound")))
    assert [f.code for f in found] == ["low_gpu_util", "data_bound"] and "data loader (data_bound below)" in found[0].cause
    assert diagnose_task(read_task(0, str(FIXTURES / "busy"))) == []


def test_doctor_cli_on_a_fixture(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "doctor", str(FIXTURES / "comm_bound"), "--json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 6, proc.stderr
    assert [f["code"] for f in json.loads(proc.stdout)] == ["low_gpu_util", "comm_bound"]
