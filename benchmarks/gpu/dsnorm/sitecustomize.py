"""packing_e2e.py's ``swiftslurm_dsnorm`` arm: swiftslurm's trainer with DeepSpeed's own gradient norm (a cast and a
norm per gradient) instead of ``norm_in_one_pass`` (swiftslurm/train/kernels/overflow.py), to measure what that
change is worth end to end in the same run. On PYTHONPATH only for that arm; changes nothing else."""

try:
    from swiftslurm.train.kernels import overflow as _overflow
except ImportError:  # not the trainer's Python
    pass
else:
    _overflow.norm_in_one_pass = lambda optimizer: False
