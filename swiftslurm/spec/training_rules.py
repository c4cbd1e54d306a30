"""Cross-field rules of [train] for preference training (DPO) and the low-rank optimizers (GaLore, APOLLO).

Pure: each rule looks at a validated ``TrainTable`` and returns messages with the domain reason and the
alternative (``TrainTable._cross`` raises the first). Kept apart from model.py so a feature's rules read whole.
"""

from __future__ import annotations

import json
from typing import Any

from ..tasks import TASKS
from .reward_rules import reward_problems

LOW_RANK = ("galore_adamw", "galore_adamw_8bit", "apollo_adamw")


def _changed(t: Any, keys: tuple[str, ...]) -> list[str]:
    """The keys whose value is not the default (a spec read back from a plan file has every key set)."""
    return [k for k in keys if getattr(t, k) != type(t).model_fields[k].default]


def train_problems(t: Any) -> list[str]:
    """Every cross-field problem of a [train] table (packing does not apply to DPO: a pair's two sequences are
    scored side by side, never packed; the trainer logs packing off)."""
    out: list[str] = []
    if t.optimizer in LOW_RANK and t.deepspeed != "none":
        out.append(
            f"optimizer = {t.optimizer!r} cannot run under DeepSpeed (train.deepspeed = {t.deepspeed!r}): GaLore and "
            "APOLLO project each weight matrix's 2-D gradient, and every ZeRO stage (0 included) hands the optimizer "
            "flattened 1-D partitions. HINT: set train.deepspeed = \"none\" (plain DDP; GaLore's saving is the "
            "optimizer state, which ZeRO would otherwise shard), or optimizer = \"adamw\" to keep ZeRO")
    if t.optimizer in LOW_RANK and t.train_type == "lora":
        out.append(
            f"optimizer = {t.optimizer!r} with train_type = \"lora\": GaLore/APOLLO make full-rank training cheap in "
            "optimizer memory; LoRA's matrices are already low-rank and small. HINT: train_type = \"full\", or "
            "optimizer = \"adamw\" for LoRA")
    galore_keys = _changed(t, ("galore_rank", "galore_update_proj_gap", "galore_scale"))
    if galore_keys and t.optimizer not in LOW_RANK:
        out.append(f"{', '.join(galore_keys)} set with optimizer = {t.optimizer!r}: they configure the low-rank "
                   "optimizers only. HINT: optimizer = \"galore_adamw\" (or galore_adamw_8bit, apollo_adamw), or drop them")
    if t.gradient_checkpointing is False and t.gradient_checkpointing_layers is not None:
        out.append(
            f"gradient_checkpointing_layers = {t.gradient_checkpointing_layers} with gradient_checkpointing = false: it "
            "says how many layers recompute their activations, and none do. HINT: drop it, or set "
            "gradient_checkpointing = true (or \"auto\")")
    if t.attn_implementation == "varlen_attn":
        packs = TASKS[t.task].packs
        if not packs or not t.packing:
            out.append(
                "attn_implementation = \"varlen_attn\" needs packed rows: it reads where each sample starts from the "
                f"packing collator, and {'packing is off' if packs else 'task = ' + repr(t.task) + ' never packs'} "
                "(padded batches carry a mask this kernel cannot apply). HINT: set packing = true (SFT), or "
                "attn_implementation = \"auto\"")
        elif not (t.bf16 or t.fp16):
            out.append(
                "attn_implementation = \"varlen_attn\" needs bf16 or fp16: it is a flash kernel, which has no fp32 "
                "path. HINT: set bf16 = true, or attn_implementation = \"auto\"")
    if t.compile and t.use_liger_kernel is True:
        out.append(
            "compile = true with use_liger_kernel = true: torch.compile could not trace Liger's kernels (on an H200 "
            "dynamo failed in LigerRMSNormFunction, an AssertionError, before the first step), and it fuses the same "
            "elementwise work itself. HINT: drop use_liger_kernel (\"auto\" leaves it off with compile), or drop compile")
    if t.task == "dpo":
        if t.use_liger_kernel is True:
            out.append(
                "use_liger_kernel = true with task = \"dpo\": TRL's DPOTrainer scores chosen and rejected with its own "
                "log-probability pass, which Liger's fused loss replaces for SFT only (and TRL refuses Liger with "
                "precompute_ref_log_probs). HINT: drop use_liger_kernel (\"auto\" leaves it off for DPO)")
        if t.max_prompt_length is not None and t.max_prompt_length >= t.max_length:
            out.append(
                f"max_prompt_length ({t.max_prompt_length}) must be below max_length ({t.max_length}): the prompt "
                "and the completion share max_length, and a prompt that fills it leaves no completion token to "
                "score. HINT: e.g. max_prompt_length = max_length / 2")
    elif not TASKS[t.task].trl:  # our own trainer (sft, pt): the preference keys configure TRL's
        dpo_keys = _changed(t, ("dpo_beta", "dpo_loss_type", "precompute_ref_log_probs", "max_prompt_length"))
        if dpo_keys:
            out.append(f"{', '.join(dpo_keys)} set with task = {json.dumps(t.task)}: these keys only apply to preference "
                       "training. HINT: set task = \"dpo\", or drop them")
    out += reward_problems(t)  # task = "rm" / "kto" (reward_rules.py)
    return out
