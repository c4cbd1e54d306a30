"""Checkpoints in formats other than ours: what a foreign checkpoint holds (foreign), committing it under our
manifest (importer), DeepSpeed's universal format for another world size or ZeRO stage (universal, converted by
ds_convert), and the weights-only load every one of them is read through (safeload: a pickle never runs code)."""
