"""A rank imports the training stack without what no rank runs (``train/build.import_stack``): DeepSpeed without
the mlflow its autotuner imports, peft without bitsandbytes; both stay importable for a run that asks for them
(our MLflow tracker, the 8-bit optimizer). DeepSpeed's Muon kernels, which every engine's start imports, are wrapped
by ``torch.compile`` on their first call, not as they import. The CPU this saves: benchmarks/rank_start.py."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from swiftslurm.train.build import prepare_device_env
prepare_device_env()
loaded = {name: name in sys.modules for name in ("transformers", "deepspeed", "peft", "mlflow", "bitsandbytes")}
marks = [name for name, mod in sys.modules.items() if mod is None and name in ("mlflow", "bitsandbytes")]
import mlflow, bitsandbytes  # a tracker or an optimizer asking later
import torch
from deepspeed.runtime.zero.muon import original_muon
muon = type(original_muon.muon_update).__name__
print(json.dumps({"loaded": loaded, "marks_left": marks, "later": [mlflow.__name__, bitsandbytes.__name__], "muon": muon,
                  "compile": torch.compile.__module__}))
"""


def test_the_stack_imports_without_mlflow_and_bitsandbytes_which_stay_importable():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"] == {"transformers": True, "deepspeed": True, "peft": True, "mlflow": False, "bitsandbytes": False}
    assert got["marks_left"] == [] and got["later"] == ["mlflow", "bitsandbytes"]
    assert got["muon"] == "CompiledOnFirstCall" and got["compile"] == "torch"  # torch.compile itself is torch's again


def test_a_kernel_compiled_on_first_call_is_compiled_once_with_its_options_and_gives_the_compiled_result():
    from swiftslurm.train.build import CompiledOnFirstCall

    made = []

    def compile_fn(fn, **options):  # what torch.compile is called with, and a compiled function that differs
        made.append((fn, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def kernel(x, scale=1):
        """A kernel."""
        return x * scale

    lazy = CompiledOnFirstCall(compile_fn, kernel, {"mode": "max-autotune"})
    assert made == [] and lazy.__name__ == "kernel" and lazy.__doc__ == "A kernel." and lazy.__wrapped__ is kernel
    assert lazy(2, scale=3) == ("compiled", 6) and lazy(1) == ("compiled", 1)
    assert made == [(kernel, {"mode": "max-autotune"})]
