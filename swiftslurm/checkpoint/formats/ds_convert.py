"""DeepSpeed's universal-checkpoint converter, run under the weights-only loads of the ranks.

    python -m swiftslurm.checkpoint.formats.ds_convert --input_folder ... --output_folder ... (ds_to_universal's own)

``deepspeed.checkpoint.ds_to_universal`` reads every shard with ``torch.load(weights_only=False)``: run as its own
module, a pickle planted in a checkpoint that is resumed on another world size (or imported from elsewhere) ran in
the converter's process. Here ``torch.load`` is ``checkpoint.formats.safeload``'s for the whole conversion, its worker
processes included (forked with it): tensors, plain values and DeepSpeed's own classes load, anything else refuses
the file with one message naming it and the global it asked for, and nothing of it runs.
"""

from __future__ import annotations

import sys


def main() -> int:
    from deepspeed.checkpoint import ds_to_universal

    from .safeload import weights_only_loads

    args = ds_to_universal.parse_arguments()
    with weights_only_loads():
        ds_to_universal.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
