"""The built-in trainer of every task: HF Trainer + DeepSpeed + peft (``run.train``; the tasks in ``tasks/``), its
data, kernels, resume, health watches, test model and metrics.

Heavy imports (torch, transformers, deepspeed) happen inside the submodules, so importing this package
is cheap.
"""
