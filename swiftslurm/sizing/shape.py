"""A decoder-only transformer's shape (what the memory estimate and the parallel rules need) and its
parameter counts. Pure, apart from ``read_config_json`` which reads one local file (through ``fsutil.read_json``).

Counts follow the Llama/Qwen/Mistral layout: embeddings, per layer q/k/v/o projections, a gated MLP
(gate, up, down) and two RMSNorms, a final norm and an lm_head unless tied. Biases (Qwen2's q/k/v) are
below 0.1% of the total and left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fsutil import CONFIG_CAP, Unreadable, read_json

# the projections peft's "all-linear" picks in a Llama-like decoder (never lm_head)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_projections(targets: str | list[str]) -> tuple[set[str], bool]:
    """(the projections of LINEAR_NAMES that ``lora_target_modules`` adapts, exact): "all-linear" (or "all") is every
    one; a list counts the names it shares with LINEAR_NAMES (a module name ending in one, like "self_attn.q_proj",
    counts too). A list naming none of them (custom modules) is taken as every projection: exact is then False."""
    if isinstance(targets, str):
        targets = list(LINEAR_NAMES) if targets in ("all-linear", "all") else [targets]
    names = {n for n in LINEAR_NAMES for t in targets if t == n or t.endswith("." + n)}
    return (names, True) if names else (set(LINEAR_NAMES), False)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden_size / num_heads
    source: str = ""  # where the shape came from (for the plan's display)
    model_type: str | None = None  # config.json's model_type ("llama", "qwen2", ...): which kernels patch it (sizing/liger.py)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one layer."""
        h, i, d = self.hidden_size, self.intermediate_size, self.dim_per_head
        return {"q_proj": (h, self.num_heads * d), "k_proj": (h, self.num_kv_heads * d), "v_proj": (h, self.num_kv_heads * d),
                "o_proj": (self.num_heads * d, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections + two norms)."""
        return sum(a * b for a, b in self.linear_dims().values()) + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embeddings, plus the lm_head when it is not tied to them."""
        per = self.vocab_size * self.hidden_size
        return per if self.tie_word_embeddings else 2 * per

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.hidden_size

    @property
    def largest_layer_params(self) -> int:
        """The largest single module's parameters (DeepSpeed's ``largest_layer_params`` for ZeRO-3): the
        embedding matrix for any real vocabulary, else the largest projection."""
        return max([self.vocab_size * self.hidden_size] + [a * b for a, b in self.linear_dims().values()])

    def lora_params(self, rank: int, targets: str | list[str]) -> tuple[int, bool]:
        """(trainable LoRA parameters, exact): A (in x r) + B (r x out) per targeted projection and layer.

        ``targets`` "all-linear" (or "all") = every projection; a list counts the names it shares with
        LINEAR_NAMES (a module name ending in one, like "self_attn.q_proj", counts too). A list naming
        none of them (custom modules) counts all-linear, an upper bound: exact is then False.
        """
        dims = self.linear_dims()
        names, exact = lora_projections(targets)
        per_layer = sum(rank * (dims[n][0] + dims[n][1]) for n in names)
        return self.num_layers * per_layer, exact

    def to_json(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
                "head_dim": self.dim_per_head, "total_params": self.total_params, "source": self.source,
                "model_type": self.model_type}


# the built-in test model (train/tinymodel.py builds exactly this: 2 layers, 64 wide, 4 heads, byte vocabulary)
TINY_LLAMA = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                        vocab_size=259, tie_word_embeddings=False, source="tiny-llama (built in)", model_type="llama")


class ShapeError(ValueError):
    """A config.json without the keys a decoder's shape needs, or with a value out of range (the message names them)."""


# The one range of each shape number: ``train.model_shape`` (spec/parallel.py) and every config.json read here.
# Beyond these a number is a typo or a hostile file (a head count of 0 divides by zero; 10^11 heads would
# make every rule that lists divisors spin for minutes).
SHAPE_BOUNDS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1_000_000),
    "num_layers": (1, 100_000),
    "heads": (1, 100_000),
    "kv_heads": (1, 100_000),
    "intermediate_size": (1, 10_000_000),
    "vocab_size": (1, 100_000_000),
    "head_dim": (1, 100_000),
}


MODEL_TYPE_MAX = 100  # characters of a model_type kept (transformers' longest is ~30)


def shape_from_config(config: dict[str, Any], source: str = "config.json") -> ModelShape:
    """A ModelShape from a transformers config dict (Llama, Qwen2/3, Mistral, Gemma ...: the usual key names;
    a multimodal config's ``text_config`` is used when the top level has no hidden_size). ``model_type`` is the top
    level's (the type transformers and Liger dispatch on), kept when it is a short string."""
    model_type = config.get("model_type")
    model_type = model_type if isinstance(model_type, str) and 0 < len(model_type) <= MODEL_TYPE_MAX else None
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", config["text_config"].get("tie_word_embeddings"))}
    keys = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
            "num_heads": ("num_attention_heads", "n_head"), "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
            "vocab_size": ("vocab_size",)}
    bound = {"hidden_size": "hidden_size", "num_layers": "num_layers", "num_heads": "heads",
             "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}
    values: dict[str, int] = {}
    missing = []
    for field, names in keys.items():
        name = next((n for n in names if config.get(n) is not None), None)  # present: an integer in range, or refused
        if name is None:
            missing.append(names[0])
        else:
            values[field] = _bounded(config, name, bound[field], source)
    if missing:
        raise ShapeError(f"{source} has no {', '.join(missing)}")
    kv = _bounded(config, "num_key_value_heads", "kv_heads", source) if config.get("num_key_value_heads") is not None else None
    head_dim = _bounded(config, "head_dim", "head_dim", source) if config.get("head_dim") is not None else None
    return ModelShape(**values, num_kv_heads=kv or values["num_heads"], tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                      head_dim=head_dim, source=source, model_type=model_type)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded(config: dict[str, Any], name: str, bound: str, source: str) -> int:
    """``config[name]`` as an integer inside ``SHAPE_BOUNDS[bound]``, else ShapeError naming the key and the file."""
    value = config[name]
    low, high = SHAPE_BOUNDS[bound]
    if not _is_int(value) or not low <= value <= high:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ShapeError(f"{source}: {name} = {shown}, expected an integer from {low} to {high:,}")
    return value


def read_config_json(model_dir: str | Path) -> ModelShape | None:
    """The shape in ``model_dir/config.json``; None when there is no such file. ShapeError when it is unreadable
    or lacks the keys (the message says which). Reads the file."""
    path = Path(model_dir) / "config.json"
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = read_json(path, CONFIG_CAP, wide_ints=True)
    except FileNotFoundError:
        return None
    except Unreadable as exc:
        raise ShapeError(f"{path} cannot be read ({exc.why})") from None
    return shape_from_config(data, str(path))
