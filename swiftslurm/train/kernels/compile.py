"""``train.compile``: regional ``torch.compile``, one graph per decoder layer (``nn.Module.compile``, in place).

Regional rather than whole-model: the layers are alike, so one compiled graph serves all of them (compile time is one
layer's, not the model's), and the parts between them (embedding, LM head and loss, LoRA's wrapper, DeepSpeed's hooks)
stay eager. ``dynamic=True``: packed rows change the sample boundaries every batch. The state dict keys do not change
(the module is compiled in place, not wrapped), so checkpoints and resume are the same with it on or off.
Off by default until measured (docs/benchmarks.md).
"""

from __future__ import annotations


def decoder_layers(model) -> list:
    """The model's repeated blocks: transformers names them ``<Arch>DecoderLayer`` (Llama, Qwen2, Mistral, Gemma...)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def compile_layers(model) -> int:
    """Compile every decoder layer in place; returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
