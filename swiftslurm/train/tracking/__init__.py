"""Experiment trackers (``train.report_to = ["wandb", "mlflow"]``) whose runs survive requeues and restarts.

One training = one tracker run, however many times Slurm requeues it or it restarts: the run ids live in the
task dir (``taskdir.TRACKER_FILE``), and every start that continues the training continues that run, with the
step axis unbroken (each step is sent once; steps replayed after a resume from an older checkpoint are not
sent again). Only rank 0 talks to the trackers.

- ``identity.py``  pure: which trackers, the run's name and group, the environment defaults, the config, when a
                   start continues the run
- ``runfile.py``   the run-id files (read through fsutil, ids checked, written atomically), the steps already sent
- ``sinks.py``     W&B and MLflow themselves: open a run (new or continued), log a step, close
- ``session.py``   ``open_trackers``: the Trainer callback the trainer adds, owned by its ExitStack

Importing this package is cheap: ``validate`` (login side) reads ``identity`` without importing either library.
"""
