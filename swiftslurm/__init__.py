"""swiftslurm: one TOML job spec to multi-node DeepSpeed fine-tuning on Slurm."""

__version__ = "0.1.0"
