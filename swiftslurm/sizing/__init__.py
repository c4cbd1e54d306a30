"""Sizing a job before launch (pure): the model's shape, the parallel layout (data x sequence x tensor
parallel ranks) and its rules, and the per-rank GPU memory estimate that `plan` prints.

Plain values in, plain values out: ``shape.py`` (ModelShape, parameter counts, config.json -> shape),
``layout.py`` (degrees -> data-parallel size, and every refused combination as a Problem),
``memory.py`` (DeepSpeed's model-state formulas + activations + overhead -> MemoryEstimate).
"""
