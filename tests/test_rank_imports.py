"""A rank imports the training stack without what no rank runs (``train/build.import_stack``): DeepSpeed without
the mlflow its autotuner imports, peft without bitsandbytes; both stay importable for a run that asks for them
(our MLflow tracker, the 8-bit optimizer). The CPU this saves: benchmarks/rank_start.py."""

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
print(json.dumps({"loaded": loaded, "marks_left": marks, "later": [mlflow.__name__, bitsandbytes.__name__]}))
"""


def test_the_stack_imports_without_mlflow_and_bitsandbytes_which_stay_importable():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"] == {"transformers": True, "deepspeed": True, "peft": True, "mlflow": False, "bitsandbytes": False}
    assert got["marks_left"] == [] and got["later"] == ["mlflow", "bitsandbytes"]
