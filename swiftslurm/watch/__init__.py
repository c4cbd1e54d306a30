"""Watching a run: progress rows, logs by rank and plots, read from the files the ranks already write.

Nothing here prints or calls Slurm itself: ``progress`` turns a task dir (metrics.jsonl, train-summary.json,
requeues.json, checkpoints, the plan) plus its Slurm/local status into rows; ``logs`` turns rank logs into
time-ordered lines and error reports; ``plot`` draws a figure. ``cli/`` renders them.
"""
