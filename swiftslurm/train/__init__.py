"""The built-in SFT trainer: HF Trainer + DeepSpeed + peft (``sft.train``), its data, test model and metrics.

Heavy imports (torch, transformers, deepspeed) happen inside the submodules, so importing this package
is cheap.
"""
