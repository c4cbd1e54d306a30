"""``model = "tiny-llama"`` and ``"tiny-moe"``: test models built from a config, with a tokenizer that needs no download.

``tiny-llama``: a 2-layer, 64-wide LlamaForCausalLM. ``tiny-moe``: a 2-layer, 64-wide Qwen3-MoE (4 experts of 32,
top-2, every layer sparse; issue 55). Both have random weights (seeded) and a byte-level tokenizer (one token per
UTF-8 byte plus <pad>, <s>, </s>) built in code with ``tokenizers``. They exist so the demo and the tests run offline
in seconds; they learn the shipped data but are not useful language models.
"""

from __future__ import annotations

TINY_LLAMA = "tiny-llama"
TINY_MOE = "tiny-moe"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    r"{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
    r"{% if m['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer():
    """A byte-level PreTrainedTokenizerFast: vocab = 3 special tokens + 256 byte symbols, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama(vocab_size: int, max_length: int, hidden_size: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max(max_length, 64), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    return config, LlamaForCausalLM, LlamaForSequenceClassification


def _moe(vocab_size: int, max_length: int, hidden_size: int, layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                            moe_intermediate_size=hidden_size // 2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            decoder_sparse_step=1, max_position_embeddings=max(max_length, 64), pad_token_id=0,
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config.head_dim = hidden_size // 4
    return config, Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification


TINY = {TINY_LLAMA: _llama, TINY_MOE: _moe}  # name -> (config, causal LM class, sequence-classification class)


def build_model(vocab_size: int, max_length: int, seed: int, hidden_size: int = 64, layers: int = 2, reward_head: bool = False,
                name: str = TINY_LLAMA):
    """A freshly initialised tiny model (``TINY``); the same seed gives the same weights. ``reward_head``: its
    sequence-classification class with one output (a reward model's score) instead of the LM head."""
    import torch

    config, causal, scored = TINY[name](vocab_size, max_length, hidden_size, layers)
    with torch.random.fork_rng(devices=[]):  # built on the CPU: leave every GPU untouched
        torch.manual_seed(seed)
        if reward_head:  # one score per sequence; through from_config: under ZeRO-3 its zero.Init covers the score head too, not only the backbone
            config.num_labels = 1
            return scored._from_config(config)
        return causal(config)
