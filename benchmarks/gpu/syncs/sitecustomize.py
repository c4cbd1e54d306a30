"""packing_e2e.py's ``swiftslurm_syncs`` arm: swiftslurm's trainer with the two host syncs per step it took out put
back, to measure them end to end in the same run. On PYTHONPATH only for that arm; changes nothing else.

- ``varlen.register`` registers transformers' flash mask rule again, so every forward first runs
  ``find_packed_sequence_indices`` (an ``.all()`` read on the host);
- the gradient norm of ``norm_in_one_pass`` is masked by DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` again
  (a device tensor made from -1.0 and a fill from it: two reads), after swiftslurm's own mask (same value)."""

try:
    from swiftslurm.train.kernels import overflow as _overflow
    from swiftslurm.train.kernels import varlen as _varlen
except ImportError:  # not the trainer's Python
    pass
else:
    _register, _norm = _varlen.register, _overflow.norm_in_one_pass

    def register():
        _register()
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

        AttentionMaskInterface.register(_varlen.NAME, flash_attention_mask)

    def norm_in_one_pass(optimizer):
        installed = _norm(optimizer)
        zero = _overflow._zero_optimizer(optimizer)
        if installed and zero is not None and not getattr(zero, "_bench_syncs", False):
            import deepspeed.runtime.zero.stage_1_and_2 as s12

            ours = zero.get_grad_norm_direct

            def get_grad_norm_direct(gradients, params, norm_type=2):
                total = ours(gradients, params, norm_type)
                s12.mask_nan_or_inf_with_val_inplace(total, device=zero.device)
                return total

            zero.get_grad_norm_direct, zero._bench_syncs = get_grad_norm_direct, True
        return installed

    _varlen.register, _overflow.norm_in_one_pass = register, norm_in_one_pass
