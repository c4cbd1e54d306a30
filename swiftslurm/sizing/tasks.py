"""What a training task changes in the SFT memory estimate (pure; ``memory.estimate`` applies it), from its row in
``swiftslurm/tasks.py`` (``score_head``, ``reference_copy``); the built-in ones:

- ``rm``: the model's LM head (vocab x hidden, unless tied to the embeddings) is replaced by a 1-output score head
  (hidden x 1), trained whole under LoRA too (peft's ``modules_to_save``); each sample is a pair, chosen and rejected
  scored in one forward (twice the sequences of a micro-batch), and the loss reads one score per sequence, not a
  vocabulary of logits per token.
- ``kto``: full fine-tuning keeps a second, frozen copy of the starting weights as the reference model (in the model's
  dtype; ZeRO-3 shards it as it shards the policy); LoRA scores the reference with the adapter disabled and
  ``precompute_ref_log_probs`` scores it once before training: neither holds a copy.
"""

from __future__ import annotations

from ..tasks import TASKS
from .shape import ModelShape


def head_params_delta(shape: ModelShape, task: str) -> int:
    """Parameters the task's head adds to (or, negative, takes from) the causal LM's."""
    if not TASKS[task].score_head:
        return 0
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return shape.hidden_size - lm_head


def extra_trainable(shape: ModelShape, task: str, train_type: str) -> int:
    """Trainable parameters LoRA leaves whole: a reward model's score head."""
    return shape.hidden_size if TASKS[task].score_head and train_type == "lora" else 0


def sequences_per_sample(task: str) -> int:
    return 2 if TASKS[task].score_head else 1


def logits_per_token(shape: ModelShape, task: str) -> int:
    return 1 if TASKS[task].score_head else shape.vocab_size


def holds_reference_copy(task: str, train_type: str, precompute_ref_log_probs: bool) -> bool:
    return TASKS[task].reference_copy and train_type == "full" and not precompute_ref_log_probs
