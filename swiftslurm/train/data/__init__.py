"""Data for the trainer: records out of files, tokens, the memory-mapped token cache, packing, preference pairs."""
