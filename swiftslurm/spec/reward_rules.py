"""Cross-field rules of [train] for reward models (``task = "rm"``) and KTO (``task = "kto"``).

Pure, like ``training_rules``: each rule looks at a validated ``TrainTable`` and returns messages with the domain
reason and the alternative. KTO reuses DPO's ``dpo_beta`` (TRL's ``beta``: how far the policy may move from the
reference, the same meaning in both losses) and ``precompute_ref_log_probs``; its own keys are the two weights.
"""

from __future__ import annotations

from typing import Any

KTO_KEYS = ("kto_desirable_weight", "kto_undesirable_weight")
# the DPO keys a task does not read: a set value would silently do nothing
UNREAD_DPO_KEYS = {
    "rm": ("dpo_beta", "dpo_loss_type", "precompute_ref_log_probs", "max_prompt_length"),
    "kto": ("dpo_loss_type", "max_prompt_length"),
}


def _changed(t: Any, keys: tuple[str, ...]) -> list[str]:
    """The keys whose value is not the default (a spec read back from a plan file has every key set)."""
    return [k for k in keys if getattr(t, k) != type(t).model_fields[k].default]


def reward_problems(t: Any) -> list[str]:
    """The problems of a [train] table that are about rm and kto (and the KTO keys under any other task)."""
    out: list[str] = []
    kto_keys = _changed(t, KTO_KEYS) if t.task != "kto" else []
    if kto_keys:
        out.append(f"{', '.join(kto_keys)} set with task = \"{t.task}\": these keys weight KTO's losses only. "
                   "HINT: set task = \"kto\", or drop them")
    if t.task not in ("rm", "kto"):
        return out
    unread = _changed(t, UNREAD_DPO_KEYS[t.task])
    if unread:
        reads = "a reward model has no reference model and no DPO loss" if t.task == "rm" else \
            "KTO has its own loss and no prompt-length cut (it keeps the completion and truncates to max_length)"
        out.append(f"{', '.join(unread)} set with task = \"{t.task}\": {reads}, so nothing would read them. HINT: drop them")
    if t.use_liger_kernel is True:
        out.append(f"use_liger_kernel = true with task = \"{t.task}\": TRL's {'RewardTrainer' if t.task == 'rm' else 'KTOTrainer'} "
                   "scores with its own pass, and Liger was measured for SFT only. HINT: drop use_liger_kernel (\"auto\" "
                   f"leaves it off for {t.task})")
    if t.task == "rm" and t.resume_weights_only:
        out.append("train.resume_weights_only with task = \"rm\": a reward model has a 1-output score head where the "
                   "checkpoint's model has its LM head, so the weights do not map onto it. HINT: set train.model to the "
                   "model dir (merged, for an adapter): the head is created fresh there, or resume fully")
    if t.task == "kto" and t.per_device_train_batch_size < 2:
        out.append("task = \"kto\" needs per_device_train_batch_size >= 2: TRL estimates KTO's KL term from each "
                   "micro-batch's completions paired with the other prompts of that micro-batch, and one example has "
                   "no other (TRL refuses 1). HINT: per_device_train_batch_size = 2 or more (lower "
                   "gradient_accumulation_steps to keep the global batch)")
    return out
