"""Kernels the trainer picks: attention and Liger (choose), packed varlen attention, the device-side overflow skip."""
