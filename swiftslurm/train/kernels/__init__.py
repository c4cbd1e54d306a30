"""Kernels the trainer picks: attention and Liger (choose), packed varlen attention, the device-side overflow skip, and
DeepSpeed's JIT-compiled ops, built before training under a lock a dead build cannot leave behind (opbuild)."""
