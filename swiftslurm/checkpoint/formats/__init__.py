"""Checkpoints in formats other than ours: what a foreign checkpoint holds (foreign), committing it under our
manifest (importer), DeepSpeed's universal format for another world size or ZeRO stage (universal)."""
