"""`swiftslurm export`: a verified checkpoint -> a Hugging Face model directory that transformers and vLLM load.

source.py (which checkpoint SOURCE names, verified, and what it holds; no torch), weights.py (the weights: ZeRO
shards gathered, a LoRA adapter merged into its base; torch), write.py (the model dir built beside ``--to`` with our
manifest, renamed into place), job.py (the same export as a one-node Slurm job: the script, pure, and its sending).
"""
