"""packing_e2e.py's ``swiftslurm_save_trainerpath`` arm: swiftslurm's trainer saving through the Trainer's own
``save_model`` (accelerate copies the whole state dict to host memory on every rank, then the adapter is kept of it),
as before issue 54's change, to measure that save beside today's in the same run. On PYTHONPATH only for that arm."""

try:
    from transformers import Trainer as _Trainer

    from swiftslurm.train import trainer as _trainer
except ImportError:  # not the trainer's Python
    pass
else:
    _trainer.SwiftTrainer.save_model = _Trainer.save_model
