"""packing_e2e.py's ``swiftslurm_torchnorm`` arm: the defaults with torch's own fused RMSNorm (``F.rms_norm``, one
ATen op forward and one backward) in place of Liger's (a Python autograd Function and a Triton launch each way: ~28 ms
of host time per 0.5B step under the profiler, seventh run). Liger keeps its RoPE and SwiGLU. On PYTHONPATH only for
that arm; changes nothing else. Numerics: torch normalizes and scales in fp32 and rounds once; transformers' Qwen2 and
Llama RMSNorm round to bf16 before the weight (one rounding more): not bitwise the defaults' training."""

try:
    from swiftslurm.train.kernels import choose as _choose
except ImportError:  # not the trainer's Python
    pass
else:
    _choose.LIGER_FAST["rms_norm"] = False  # the dict resolve_liger hands to transformers' liger_kernel_config

    import torch.nn.functional as _F
    from transformers.models.llama import modeling_llama as _llama
    from transformers.models.qwen2 import modeling_qwen2 as _qwen2

    def _forward(self, hidden_states):
        return _F.rms_norm(hidden_states, self.weight.shape, self.weight.to(hidden_states.dtype), self.variance_epsilon)

    _qwen2.Qwen2RMSNorm.forward = _forward
    _llama.LlamaRMSNorm.forward = _forward
