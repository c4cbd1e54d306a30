"""``train.compile``: every decoder layer compiled in place, nothing else, and the state dict unchanged (issue #34)."""

from __future__ import annotations

from swiftslurm.spec.load import parse_toml, validate_spec
from swiftslurm.train.kernels.compile import compile_layers, decoder_layers


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_every_decoder_layer_and_nothing_else_is_compiled_in_place():
    model = tiny_llama()
    keys = list(model.state_dict())
    assert compile_layers(model) == 3
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == decoder_layers(model) and len(compiled) == 3
    assert list(model.state_dict()) == keys  # checkpoints and resume see the same names


def test_the_spec_key_defaults_off():
    spec = validate_spec(parse_toml('[job]\nname = "j"\n[train]\nmodel = "tiny-llama"\ndataset = "d.jsonl"\n'))
    assert spec.train.compile is False
    on = validate_spec(parse_toml('[job]\nname = "j"\n[train]\nmodel = "tiny-llama"\ndataset = "d.jsonl"\ncompile = true\n'))
    assert on.train.compile is True
