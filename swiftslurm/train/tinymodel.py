"""``model = "tiny-llama"``, ``"tiny-moe"`` and ``"tiny-vl"``: test models built from a config, with a tokenizer (and
for ``tiny-vl`` an image processor) that need no download.

``tiny-llama``: a 2-layer, 64-wide LlamaForCausalLM. ``tiny-moe``: a 2-layer, 64-wide Qwen3-MoE (4 experts of 32,
top-2, every layer sparse; issue 55). ``tiny-vl``: a LLaVA (issue 56): a 2-layer, 32-wide CLIP vision tower on 28x28
images in patches of 14, a 2-layer MLP projector and the 2-layer, 64-wide Llama, with a ``LlavaProcessor`` over
``CLIPImageProcessorPil`` (the PIL backend: no torchvision, which does not import beside this torch build, while
Qwen2-VL's processor needs it). An image is 4 ``<image>`` tokens in the sequence (2x2 patches, the CLS feature dropped).
All have random weights (seeded) and a byte-level tokenizer (one token per UTF-8 byte plus <pad>, <s>, </s>, and
``tiny-vl``'s <image>) built in code with ``tokenizers``. They exist so the demo and the tests run offline in seconds;
they learn the shipped data but are not useful language models.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

TINY_LLAMA = "tiny-llama"
TINY_MOE = "tiny-moe"
TINY_VL = "tiny-vl"
IMAGE_TOKEN = "<image>"  # tiny-vl's placeholder, as LLaVA and the records write it
IMAGE_SIDE, PATCH = 28, 14  # tiny-vl's vision tower: 28x28 pixels in patches of 14
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    r"{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
    r"{% if m['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(name: str = TINY_LLAMA):
    """A byte-level PreTrainedTokenizerFast: vocab = 3 special tokens + 256 byte symbols, no merges, then the special
    tokens the model ``name`` needs beyond them (``Tiny.extra_tokens``)."""
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
    if TINY[name].extra_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(TINY[name].extra_tokens)})
    return fast


def build_processing(name: str = TINY_LLAMA):
    """What the Trainer calls the processing class of the model ``name``: its tokenizer, or its processor (tokenizer and
    image processor) for a vision-language model."""
    tok = build_tokenizer(name)
    make = TINY[name].processor
    return make(tok) if make is not None else tok


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


def _llava(vocab_size: int, max_length: int, hidden_size: int, layers: int):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    vision = dict(model_type="clip_vision_model", hidden_size=hidden_size // 2, intermediate_size=hidden_size,
                  num_hidden_layers=layers, num_attention_heads=2, image_size=IMAGE_SIDE, patch_size=PATCH,
                  projection_dim=hidden_size // 2)
    text, _, _ = _llama(vocab_size, max_length, hidden_size, layers)
    config = LlavaConfig(vision_config=vision, text_config=text.to_dict(), image_token_index=vocab_size - 1,
                         vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
                         tie_word_embeddings=False)
    return config, LlavaForConditionalGeneration, None


def _llava_processor(tok):
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default",
                          chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN, num_additional_image_tokens=1)


@dataclass(frozen=True)
class Tiny:
    """One built-in model: what differs between them."""

    config: Callable[[int, int, int, int], tuple[Any, Any, Any]]  # (vocab, max_length, width, layers) -> (config,
    # causal LM class, sequence-classification class or None)
    extra_tokens: tuple[str, ...] = ()  # special tokens its inputs need beyond SPECIAL_TOKENS (the last is the last id)
    processor: Callable[[Any], Any] | None = None  # tokenizer -> its processor (a vision-language model)


TINY = {TINY_LLAMA: Tiny(_llama), TINY_MOE: Tiny(_moe),
        TINY_VL: Tiny(_llava, extra_tokens=(IMAGE_TOKEN,), processor=_llava_processor)}


def build_model(vocab_size: int, max_length: int, seed: int, hidden_size: int = 64, layers: int = 2, reward_head: bool = False,
                name: str = TINY_LLAMA):
    """A freshly initialised tiny model (``TINY``); the same seed gives the same weights. ``reward_head``: its
    sequence-classification class with one output (a reward model's score) instead of the LM head."""
    import torch

    config, causal, scored = TINY[name].config(vocab_size, max_length, hidden_size, layers)
    with torch.random.fork_rng(devices=[]):  # built on the CPU: leave every GPU untouched
        torch.manual_seed(seed)
        if reward_head:  # one score per sequence; through from_config: under ZeRO-3 its zero.Init covers the score head too, not only the backbone
            config.num_labels = 1
            return scored._from_config(config)
        with built_whole():
            return causal(config)


@contextmanager
def built_whole():
    """No ZeRO-3 partitioning while a model is constructed in this block. With a ZeRO-3 config live, transformers
    partitions (``zero.Init``) every sub-model a composite model builds through ``from_config``: tiny-vl's vision
    tower and language model would be, its projector and LM head not, and DeepSpeed's engine casts only the
    parameters it partitions itself to bf16, so the fp32 projector met bf16 features. Built whole, the engine
    converts the whole model as it does tiny-llama's. (``resume.weights.model_names`` builds a plain model in it too.)"""
    from transformers.integrations import deepspeed as hf_deepspeed

    live = hf_deepspeed._hf_deepspeed_config_weak_ref  # the Trainer's HfTrainerDeepSpeedConfig, held weakly
    held = live() if live is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if held is not None:
            hf_deepspeed.set_hf_deepspeed_config(held)
