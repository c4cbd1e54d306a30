"""``model = "tiny-llama"``: a test model built from a config, with a tokenizer that needs no download.

A 2-layer, 64-wide LlamaForCausalLM with random weights (seeded) and a byte-level tokenizer (one token
per UTF-8 byte plus <pad>, <s>, </s>) built in code with ``tokenizers``. It exists so the demo and the
tests run offline in seconds; it learns the shipped data but is not a useful language model.
"""

from __future__ import annotations

TINY_LLAMA = "tiny-llama"
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


def build_model(vocab_size: int, max_length: int, seed: int, hidden_size: int = 64, layers: int = 2, reward_head: bool = False):
    """A freshly initialised tiny Llama; the same seed gives the same weights. ``reward_head``: a
    LlamaForSequenceClassification with one output (a reward model's score) instead of the LM head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max(max_length, 64),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # built on the CPU: leave every GPU untouched
        torch.manual_seed(seed)
        if reward_head:  # one score per sequence; through from_config: under ZeRO-3 its zero.Init covers the score head too, not only the backbone
            config.num_labels = 1
            return LlamaForSequenceClassification._from_config(config)
        return LlamaForCausalLM(config)
