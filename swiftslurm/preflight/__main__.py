"""``python -m swiftslurm.preflight SPEC OUTPUT_DIR [--mode preflight|train]``: run the gate on this rank.

A diagnostic entry for ``srun -N4 --ntasks-per-node=1 python -m swiftslurm.preflight spec.toml out/``
without a plan or a trainer: the ranks come from SLURM_* (or a single local process). Exit 0 when
the gate says continue, 4 when it does not.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import PreflightFailed, SwiftSlurmError
from ..slurm import distenv
from ..spec import load_spec
from .gate import gate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swiftslurm.preflight")
    ap.add_argument("spec")
    ap.add_argument("output_dir")
    ap.add_argument("--mode", default="preflight", choices=("preflight", "train"))
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec)
        dist = distenv.derive(os.environ, pid=os.getpid(), explicit=spec.env)
    except SwiftSlurmError as exc:
        print(f"error: {exc.message()}", file=sys.stderr)
        return exc.exit_code
    ok = gate(dist, spec, os.path.abspath(args.output_dir), mode=args.mode)
    return 0 if ok else PreflightFailed.exit_code


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a hung all-reduce thread must not keep the process alive
