"""Mixture-of-experts models (issue 55): the router's auxiliary loss on, and how evenly each layer's router spreads
the tokens.

``configure(model, coef)``: for a model whose config names experts (``num_experts``, Mixtral's ``num_local_experts``,
DeepSeek's ``n_routed_experts``), turn on ``output_router_logits`` (transformers adds ``coef`` x the load-balancing
loss to the loss: off by default there) and return what the banner says of it; None for a dense model.

``RouterLoad``: a forward hook on each router module (transformers 5's ``*TopKRouter``: it returns the logits, the
weights and the chosen experts' indices) counts the tokens each expert of each layer received; ``counts()`` hands
them to the trainer's one all-reduce at a log step and ``summary(reduced)`` turns every rank's sum into the metrics:

- ``router_load_max``: the worst layer's max/mean tokens per expert (1.0: even; ``experts / top_k``: every token to
  the same ``top_k`` experts, a collapsed router, which ``doctor`` reports);
- ``router_load_mean``: that ratio averaged over the layers; ``router_idle_experts``: experts (over all layers) that
  received no token since the last log; ``router_load_limit``: the ceiling, ``experts / top_k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# where each MoE layout keeps its expert count and top-k in config.json (a registry, not a branch per model)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")
# what transformers' experts implementation (chosen at load: grouped_mm where torch can dispatch it) means
EXPERT_KERNELS = {"grouped_mm": "grouped_mm (transformers' default: one grouped GEMM per layer over every expert)",
                  "batched_mm": "batched_mm (one batched GEMM per layer)",
                  "eager": "eager (a Python loop over the experts: torch could not dispatch grouped_mm here)",
                  "liger": "Liger's fused experts (its SwiGLU patch replaces the model's: Triton kernels for gate/up with "
                           "SwiGLU and for down, keeping only each routed copy's gate/up output for the backward)"}


@dataclass(frozen=True)
class MoeFacts:
    experts: int
    top_k: int
    aux_loss_coef: float
    routers: int = 0  # router modules hooked
    kernel: str | None = None  # transformers' experts implementation as loaded: grouped_mm, eager, ...

    def banner(self) -> str:
        kernel = EXPERT_KERNELS.get(self.kernel or "", self.kernel or "the model's own")
        return (f"{self.experts} experts, top-{self.top_k}, {self.routers} routed layers; router auxiliary loss x "
                f"{self.aux_loss_coef:g} (train.router_aux_loss_coef); experts: {kernel}")


def _first(config: Any, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _text(config: Any) -> Any:
    """The language model's config (a vision-language config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def expert_counts(config: Any) -> tuple[int, int] | None:
    """(experts, top_k) of a model config, None for a dense model."""
    text = _text(config)
    experts = _first(text, EXPERT_KEYS)
    return (experts, _first(text, TOP_K_KEYS) or 1) if experts else None


DEFAULT_AUX_LOSS_COEF = 0.001  # Qwen3-MoE's and Mixtral's configs' own


def configure(model: Any, coef: float | None, liger_swiglu: bool = False) -> MoeFacts | None:
    """Turn the router's auxiliary loss on for an MoE model (``coef``: ``train.router_aux_loss_coef``; None: the
    config's own, else ``DEFAULT_AUX_LOSS_COEF``; 0: off); None for a dense model. ``liger_swiglu``: the trainer will
    apply Liger's SwiGLU, which replaces the experts of the types in ``sizing.liger.FUSED_EXPERT_TYPES``."""
    from ..sizing.liger import FUSED_EXPERT_TYPES

    counts = expert_counts(model.config)
    if counts is None:
        return None
    text = _text(model.config)
    if coef is None:
        own = getattr(text, "router_aux_loss_coef", None)
        coef = float(own) if isinstance(own, (int, float)) and own > 0 else DEFAULT_AUX_LOSS_COEF
    text.output_router_logits = coef > 0
    text.router_aux_loss_coef = coef
    inner = model
    while inner is not None:  # the CausalLM keeps its own copy of the coefficient (set at construction)
        if hasattr(inner, "router_aux_loss_coef"):
            inner.router_aux_loss_coef = coef
        inner = getattr(inner, "model", None) if getattr(inner, "model", None) is not inner else None
    kernel = "liger" if liger_swiglu and getattr(text, "model_type", None) in FUSED_EXPERT_TYPES else \
        getattr(model.config, "_experts_implementation", None)
    return MoeFacts(*counts, aux_loss_coef=coef, routers=sum(1 for m in model.modules() if is_router(m)),
                    kernel=kernel if isinstance(kernel, str) else None)


def active_params(model: Any, total: int) -> int:
    """The parameters one token uses (for MFU's FLOPs per token): ``total`` less the routed experts it skips, each
    MoE layer's expert weights (the fused ``experts`` parameters, or one module per expert) x (1 - top_k / experts)."""
    counts = expert_counts(model.config)
    if counts is None:
        return total
    experts, top_k = counts
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}" and "lora_" not in name)
    return total - int(routed * (1 - top_k / experts))


def adapted(model: Any, dropout: float = 0.0) -> str:
    """What LoRA adapts in an MoE model (peft's "all-linear" takes the fused expert weights and the routers' as
    ``target_parameters`` where it knows the layout), and where ``train.lora_dropout`` applies."""
    configs = getattr(model, "peft_config", None) or {}
    config = next(iter(configs.values()), None)
    params = sorted(getattr(config, "target_parameters", None) or [])
    modules = sorted(getattr(config, "target_modules", None) or [])
    if params:
        drop = (f"; lora_dropout {dropout:g} on the projections, none on the expert/router weights (peft cannot drop "
                "out the input of a weight adapted as a parameter)") if dropout else ""
        return f"projections {', '.join(modules)} and the expert/router weights {', '.join(params)}{drop}"
    return f"projections {', '.join(modules)} only: the fused expert weights are not adapted"


def config_dropout(model: Any, dropout: float) -> float:
    """The ``lora_dropout`` peft's LoraConfig gets for ``model``: 0 for an MoE, whose fused expert weights peft adapts
    as parameters (``ParamWrapper``, which refuses any dropout: the input cannot be factored out of the update), and
    ``restore_dropout`` then gives the projections ``train.lora_dropout``; ``dropout`` as it is for a dense model."""
    return 0.0 if model is not None and expert_counts(model.config) is not None else dropout


def restore_dropout(model: Any, dropout: float) -> None:
    """``train.lora_dropout`` on every LoRA projection of ``model`` that peft built without one (``config_dropout``),
    the parameter-adapted expert weights left without (``adapted`` says where it applies, in the log)."""
    if not dropout:
        return
    import torch
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    for module in model.modules():
        if not isinstance(module, LoraLayer) or isinstance(module, ParamWrapper):
            continue
        for name, drop in list(module.lora_dropout.items()):
            if isinstance(drop, torch.nn.Identity):
                module.lora_dropout[name] = torch.nn.Dropout(p=dropout)


def is_router(module: Any) -> bool:
    name = type(module).__name__.lower()
    return name.endswith("router") and (hasattr(module, "num_experts") or hasattr(module, "n_routed_experts")
                                        or hasattr(module, "weight"))


class RouterLoad:
    """Tokens per expert and layer since the last log, from forward hooks on the routers (see the module's docstring)."""

    def __init__(self, model: Any, experts: int, top_k: int) -> None:
        import torch

        self.experts, self.top_k = experts, top_k
        self.routers = [m for m in model.modules() if is_router(m)]
        self._counts: list[Any] = [None] * len(self.routers)
        self._torch = torch
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.routers)]

    def _hook(self, layer: int):
        def count(module, args, output) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.is_floating_point():
                return
            seen = self._torch.bincount(indices.detach().reshape(-1), minlength=self.experts)[: self.experts]
            prev = self._counts[layer]
            self._counts[layer] = seen if prev is None else prev + seen

        return count

    def counts(self) -> list[float]:
        """This rank's counts since the last log, layer after layer (zeros for a layer that saw no token)."""
        seen = [c for c in self._counts if c is not None]
        zeros: Any = self._torch.zeros(self.experts, dtype=seen[0].dtype, device=seen[0].device) if seen else None
        rows: list[Any] = [c if c is not None else zeros for c in self._counts]
        self._counts = [None] * len(self.routers)
        # one device-to-host copy for every layer (a GPU sync per layer otherwise)
        return [float(v) for v in self._torch.cat(rows).tolist()] if seen else [0.0] * (self.experts * len(rows))

    def summary(self, reduced: list[float]) -> dict[str, float]:
        """The metrics of every rank's summed counts (``counts()`` of each, all-reduced)."""
        ratios, idle = [], 0
        for layer in range(len(self.routers)):
            row = reduced[layer * self.experts:(layer + 1) * self.experts]
            total = sum(row)
            if total <= 0:
                continue
            ratios.append(max(row) / (total / self.experts))
            idle += sum(1 for v in row if v == 0)
        if not ratios:
            return {}
        return {"router_load_max": max(ratios), "router_load_mean": sum(ratios) / len(ratios), "router_idle_experts": idle,
                "router_load_limit": self.experts / self.top_k}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
