"""Checkpoint saves off the training's path: a host snapshot of each file now, the write, hash and commit in the background.

``snapshot``: a file's contents copied to host memory and written later with the bytes a direct ``torch.save`` writes
(``StagedWrites``, the DeepSpeed checkpoint engine that takes them). ``background``: one save in flight per rank, on
a thread of its own, its figures and error handed back to the training thread. docs/checkpoints.md tells the protocol.
"""
