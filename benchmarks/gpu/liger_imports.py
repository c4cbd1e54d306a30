"""Which of Liger's model patches can import what they need with the installed transformers
(``swiftslurm.train.kernels.choose.liger_import_problem``, the check a rank makes before the Trainer applies Liger):
one line of JSON, model type -> the import's error, or null where the patch imports. Needs liger-kernel and Triton, so
on the GPU machine:

    source benchmarks/gpu/setup.sh && python3 benchmarks/gpu/liger_imports.py > $OUT/liger_imports.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from swiftslurm.train.kernels.choose import liger_import_problem

    print(json.dumps({t: liger_import_problem(t) for t in sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}))


if __name__ == "__main__":
    main()
