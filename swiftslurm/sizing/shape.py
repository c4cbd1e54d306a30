"""A decoder-only transformer's shape (what the memory estimate and the parallel rules need) and its
parameter counts. Pure, apart from ``read_config_json`` which reads one local file (through ``fsutil.read_json``).

Counts follow the Llama/Qwen/Mistral layout: embeddings, per layer q/k/v/o projections, a gated MLP
(gate, up, down) and two RMSNorms, a final norm and an lm_head unless tied. Biases (Qwen2's q/k/v) and q/k norms
are below 0.1% of the total and left out.

Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: ``MOE_LAYOUTS``) replace the MLP with a router
(experts x hidden), the routed experts (transformers 5 fuses them into two 3D parameters, gate_up_proj
[E, 2I, H] and down_proj [E, H, I]) and, in Qwen2-MoE, a shared expert with its 1-output gate. A token runs
through ``experts_per_token`` of the routed experts: ``active_params`` counts those, ``total_params`` all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..fsutil import CONFIG_CAP, Unreadable, read_json

# the projections peft's "all-linear" picks in a Llama-like decoder (never lm_head)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the words ``lora_target_modules`` takes for "every linear layer" (peft's, and the short form users write)
ALL_LINEAR = frozenset({"all-linear", "all"})


def target_names(targets: str | list[str]) -> list[str] | None:
    """``lora_target_modules`` as a list of module names, or None where it means every linear layer (``ALL_LINEAR``)."""
    if isinstance(targets, str):
        return None if targets in ALL_LINEAR else [targets]
    return None if any(t in ALL_LINEAR for t in targets) else list(targets)


def lora_projections(targets: str | list[str]) -> tuple[set[str], bool]:
    """(the projections of LINEAR_NAMES that ``lora_target_modules`` adapts, exact): "all-linear" (or "all") is every
    one; a list counts the names it shares with LINEAR_NAMES (a module name ending in one, like "self_attn.q_proj",
    counts too). A list naming none of them (custom modules) is taken as every projection: exact is then False."""
    listed = target_names(targets)
    names = {n for n in LINEAR_NAMES for t in (LINEAR_NAMES if listed is None else listed) if t == n or t.endswith("." + n)}
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
    num_experts: int = 0  # routed experts of each MoE layer; 0 = a dense model
    experts_per_token: int = 0  # routed experts each token runs through (top-k)
    moe_intermediate_size: int | None = None  # one expert's MLP width; None: intermediate_size (Mixtral, OLMoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, which every token runs through (0: none)
    dense_layers: int = 0  # MoE models: layers with a dense MLP of intermediate_size (mlp_only_layers, decoder_sparse_step)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def attention_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each attention projection of one layer."""
        h, d = self.hidden_size, self.dim_per_head
        return {"q_proj": (h, self.num_heads * d), "k_proj": (h, self.num_kv_heads * d), "v_proj": (h, self.num_kv_heads * d),
                "o_proj": (self.num_heads * d, h)}

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection (nn.Linear) of one dense layer: the attention and the gated MLP. An MoE
        layer has the same attention; its experts are 3D parameters, not Linear layers (``moe_layer_params``)."""
        h, i = self.hidden_size, self.intermediate_size
        return {**self.attention_dims(), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        """Parameters of one dense decoder layer (projections + two norms); an MoE layer's: ``moe_layer_params``."""
        return sum(a * b for a, b in self.linear_dims().values()) + 2 * self.hidden_size

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is experts (0 for a dense model)."""
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up and down (gate_up_proj [2I, H] + down_proj [H, I] of the fused parameters)."""
        return 3 * self.hidden_size * self.expert_width

    @property
    def shared_expert_params(self) -> int:
        """The shared expert's gated MLP and its 1-output gate (Qwen2-MoE); 0 without one."""
        width = self.shared_expert_intermediate_size
        return 3 * self.hidden_size * width + self.hidden_size if width else 0

    def moe_layer_params(self, experts: int | None = None) -> int:
        """One MoE layer: attention, two norms, the router (experts x hidden), ``experts`` routed experts (None: all of
        them; ``experts_per_token``: what one token runs through) and the shared expert."""
        routed = self.num_experts if experts is None else experts
        attention = sum(a * b for a, b in self.attention_dims().values())
        return attention + 2 * self.hidden_size + self.num_experts * self.hidden_size + routed * self.expert_params \
            + self.shared_expert_params

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every layer: what expert parallel splits across its ranks."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def decoder_params(self) -> int:
        """Every decoder layer: the dense ones and the MoE ones."""
        return (self.num_layers - self.moe_layers) * self.layer_params + self.moe_layers * self.moe_layer_params()

    @property
    def embedding_params(self) -> int:
        """Input embeddings, plus the lm_head when it is not tied to them."""
        per = self.vocab_size * self.hidden_size
        return per if self.tie_word_embeddings else 2 * per

    @property
    def total_params(self) -> int:
        return self.decoder_params + self.embedding_params + self.hidden_size

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: a dense model's all; an MoE model's attention, routers, shared
        experts and ``experts_per_token`` routed experts of each MoE layer, the dense layers, the embeddings."""
        if not self.is_moe:
            return self.total_params
        return (self.num_layers - self.moe_layers) * self.layer_params + \
            self.moe_layers * self.moe_layer_params(self.experts_per_token) + self.embedding_params + self.hidden_size

    @property
    def largest_layer_params(self) -> int:
        """The largest single parameter (DeepSpeed's ``largest_layer_params`` for ZeRO-3): the embedding matrix for
        any real vocabulary, else the largest projection; an MoE layer's fused gate_up_proj [E, 2I, H] when larger."""
        fused = 2 * self.num_experts * self.expert_width * self.hidden_size if self.moe_layers else 0
        return max([self.vocab_size * self.hidden_size, fused] + [a * b for a, b in self.linear_dims().values()])

    def lora_params(self, rank: int, targets: str | list[str]) -> tuple[int, bool]:
        """(trainable LoRA parameters, exact): A (in x r) + B (r x out) per targeted projection and layer.

        ``targets`` "all-linear" (or "all") = every projection; a list counts the names it shares with
        LINEAR_NAMES (a module name ending in one, like "self_attn.q_proj", counts too). A list naming
        none of them (custom modules) counts all-linear, an upper bound: exact is then False.
        An MoE shape counts the attention projections of every layer, the MLP ones of its dense layers and shared
        experts; how peft treats the routers and the fused experts varies, so exact is then False.
        """
        dims = self.linear_dims()
        names, exact = lora_projections(targets)
        lora = lambda chosen: sum(rank * (dims[n][0] + dims[n][1]) for n in names & chosen)  # noqa: E731
        attention, mlp = lora(set(self.attention_dims())), lora(set(dims) - set(self.attention_dims()))
        if not self.is_moe:
            return self.num_layers * (attention + mlp), exact
        shared = self.shared_expert_intermediate_size
        shared_mlp = sum(rank * (self.hidden_size + shared) for n in names if n in ("gate_proj", "up_proj", "down_proj"))
        return self.num_layers * attention + self.dense_layers * mlp + (self.moe_layers * shared_mlp if shared else 0), False

    def to_json(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
                "head_dim": self.dim_per_head, "total_params": self.total_params, "source": self.source,
                "model_type": self.model_type, **(self.moe_json() if self.is_moe else {})}

    def moe_json(self) -> dict[str, Any]:
        """An MoE shape's expert numbers and its active parameters (what ``plan --json`` adds for one)."""
        return {"num_experts": self.num_experts, "experts_per_token": self.experts_per_token,
                "moe_intermediate_size": self.expert_width, "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "dense_layers": self.dense_layers, "active_params": self.active_params,
                "routed_expert_params": self.routed_expert_params}


# the built-in test models (train/tinymodel.py builds exactly these: 2 layers, 64 wide, 4 heads, byte vocabulary)
TINY_LLAMA = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                        vocab_size=259, tie_word_embeddings=False, source="tiny-llama (built in)", model_type="llama")
TINY_MOE = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=259,
                      head_dim=16, source="tiny-moe (built in)", model_type="qwen3_moe", num_experts=4, experts_per_token=2,
                      moe_intermediate_size=32)
# tiny-vl: a LLaVA whose language model is tiny-llama with one more token (<image>); its vision tower is sized apart
TINY_VL = replace(TINY_LLAMA, vocab_size=260, source="tiny-vl (built in: its language model)")
BUILT_IN_SHAPES = {"tiny-llama": TINY_LLAMA, "tiny-moe": TINY_MOE, "tiny-vl": TINY_VL}  # train.model names built in code -> their shape


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
    "experts": (0, 100_000),  # 0: dense
    "experts_per_token": (1, 100_000),
    "shared_expert_intermediate_size": (0, 10_000_000),
}


@dataclass(frozen=True)
class MoeKeys:
    """Where one MoE layout keeps its expert numbers in config.json (``MOE_LAYOUTS``)."""

    experts: tuple[str, ...]  # the routed expert count (transformers 5 writes num_local_experts for num_experts)
    top_k: str = "num_experts_per_tok"
    width: str | None = "moe_intermediate_size"  # one expert's width; None: intermediate_size is the expert's
    shared_width: str | None = None  # the shared expert's width
    sparse_step: str | None = None  # every this-many-th layer has experts (the others a dense MLP)
    dense_list: str | None = None  # the layer indices with a dense MLP


# config.json's model_type -> its MoE keys (transformers 5's configurations of each)
MOE_LAYOUTS: dict[str, MoeKeys] = {
    "qwen3_moe": MoeKeys(("num_experts", "num_local_experts"), sparse_step="decoder_sparse_step", dense_list="mlp_only_layers"),
    "qwen2_moe": MoeKeys(("num_experts", "num_local_experts"), shared_width="shared_expert_intermediate_size", sparse_step="decoder_sparse_step",
                         dense_list="mlp_only_layers"),
    "mixtral": MoeKeys(("num_local_experts", "num_experts"), width=None),
    "olmoe": MoeKeys(("num_experts", "num_local_experts"), width=None),
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
    layout = MOE_LAYOUTS.get(model_type or "") or MOE_LAYOUTS.get(str(config.get("model_type")))  # a text_config's own type
    moe = _moe_fields(config, layout, values["num_layers"], source) if layout is not None else {}
    return ModelShape(**values, num_kv_heads=kv or values["num_heads"], tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                      head_dim=head_dim, source=source, model_type=model_type, **moe)


def _moe_fields(config: dict[str, Any], keys: MoeKeys, num_layers: int, source: str) -> dict[str, Any]:
    """The ModelShape's expert fields from an MoE layout's keys; {} (dense) when the expert count is 0."""
    name = next((n for n in keys.experts if config.get(n) is not None), None)
    if name is None:
        raise ShapeError(f"{source} is a {config.get('model_type')} config without {' or '.join(keys.experts)}")
    experts = _bounded(config, name, "experts", source)
    if not experts:
        return {}
    if config.get(keys.top_k) is None:
        raise ShapeError(f"{source} has {name} = {experts} but no {keys.top_k}")
    top_k = _bounded(config, keys.top_k, "experts_per_token", source)
    if top_k > experts:
        raise ShapeError(f"{source}: {keys.top_k} = {top_k} is more than the {experts} experts ({name})")
    width = _bounded(config, keys.width, "intermediate_size", source) if keys.width and config.get(keys.width) is not None else None
    shared = _bounded(config, keys.shared_width, "shared_expert_intermediate_size", source) \
        if keys.shared_width and config.get(keys.shared_width) is not None else 0
    step = _bounded(config, keys.sparse_step, "num_layers", source) if keys.sparse_step and config.get(keys.sparse_step) is not None else 1
    listed = config.get(keys.dense_list) if keys.dense_list else None
    if listed is not None and (not isinstance(listed, list) or not all(_is_int(i) for i in listed)):
        raise ShapeError(f"{source}: {keys.dense_list} is not a list of layer indices")
    dense = {i for i in range(num_layers) if (i + 1) % step} | {i for i in listed or [] if 0 <= i < num_layers}
    return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": width,
            "shared_expert_intermediate_size": shared, "dense_layers": len(dense)}


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
