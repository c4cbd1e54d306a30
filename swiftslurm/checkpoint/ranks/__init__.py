"""What the ranks decide together about a checkpoint: one resume point for all (``agree``: rank 0 decides, every rank
checks it can read it) and the start-up verification split across them (``split``: each rank hashes a share)."""
