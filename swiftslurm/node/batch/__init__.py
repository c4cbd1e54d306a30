"""What runs in the batch script beside the ranks: the in-job restart supervisor (``supervise``) and its per-node probe.

The rank runtime is ``node/`` itself; the supervisor only starts, watches and restarts the training step.
"""
