"""The ``[parallel]`` table (how each model replica is split across ranks) and ``train.model_shape`` (the
shape of a hub model that is not on disk, for the memory estimate and the head rules).

Degrees only here; the rules that need the world size, the ZeRO stage or the model's heads run in
``plan`` (``sizing.layout``), where every problem is reported at once. Unknown keys are refused like everywhere else.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sizing.shape import MODEL_TYPE_MAX, SHAPE_BOUNDS, ModelShape

MAX_DEGREE = 1024


class Table(BaseModel):
    """The config of every spec table (``model._Table``, which imports this module)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ParallelTable(Table):
    sequence_parallel: int = Field(1, ge=1, le=MAX_DEGREE)
    tensor_parallel: int = Field(1, ge=1, le=MAX_DEGREE)
    tiled_mlp: bool = False  # DeepSpeed's TiledMLP: the MLP over ceil(seq / hidden) slices of the sequence
    expert: int = Field(1, ge=1, le=MAX_DEGREE, description=(
        "DeepSpeed AutoEP degree for mixture-of-experts models: each MoE layer's routed experts are split over this many "
        "data-parallel ranks, tokens sent to their experts by all-to-all (DeepSpeed's `expert_parallel.autoep_size`). "
        "It must divide the data-parallel size and the expert count; a model type AutoEP has a preset for (Mixtral, "
        "Qwen2/3-MoE, Qwen3.5-MoE, DeepSeek-V2/V3; not OLMoE); ZeRO 0-2; GPU jobs only; not with sequence or tensor "
        "parallel. 1 = every rank holds every expert"))


class ModelShapeTable(Table):
    # ranges: SHAPE_BOUNDS, the same ones a local config.json is held to (sizing/shape.py)
    hidden_size: int = Field(..., ge=SHAPE_BOUNDS["hidden_size"][0], le=SHAPE_BOUNDS["hidden_size"][1])
    num_layers: int = Field(..., ge=SHAPE_BOUNDS["num_layers"][0], le=SHAPE_BOUNDS["num_layers"][1])
    heads: int = Field(..., ge=SHAPE_BOUNDS["heads"][0], le=SHAPE_BOUNDS["heads"][1])
    # None: as many as heads (no grouped-query attention)
    kv_heads: int | None = Field(None, ge=SHAPE_BOUNDS["kv_heads"][0], le=SHAPE_BOUNDS["kv_heads"][1])
    intermediate_size: int = Field(..., ge=SHAPE_BOUNDS["intermediate_size"][0], le=SHAPE_BOUNDS["intermediate_size"][1])
    vocab_size: int = Field(..., ge=SHAPE_BOUNDS["vocab_size"][0], le=SHAPE_BOUNDS["vocab_size"][1])
    tie_word_embeddings: bool = False
    head_dim: int | None = Field(None, ge=SHAPE_BOUNDS["head_dim"][0], le=SHAPE_BOUNDS["head_dim"][1])
    # config.json's model_type: which of Liger's kernels the memory estimate counts (None: none)
    model_type: str | None = Field(None, min_length=1, max_length=MODEL_TYPE_MAX)
    experts: int = Field(0, ge=SHAPE_BOUNDS["experts"][0], le=SHAPE_BOUNDS["experts"][1], description=(
        "mixture-of-experts models: the routed experts of each MoE layer (config.json's `num_experts`, Mixtral's "
        "`num_local_experts`); 0 = a dense model"))
    experts_per_token: int | None = Field(None, ge=SHAPE_BOUNDS["experts_per_token"][0], le=SHAPE_BOUNDS["experts_per_token"][1],
                                          description="the routed experts each token runs through (`num_experts_per_tok`); "
                                                      "required with `experts`")
    moe_intermediate_size: int | None = Field(None, ge=SHAPE_BOUNDS["intermediate_size"][0], le=SHAPE_BOUNDS["intermediate_size"][1],
                                              description="one expert's MLP width (Qwen-MoE's `moe_intermediate_size`); "
                                                          "unset: `intermediate_size` is the expert's (Mixtral, OLMoE)")
    shared_expert_intermediate_size: int = Field(0, ge=SHAPE_BOUNDS["shared_expert_intermediate_size"][0],
                                                 le=SHAPE_BOUNDS["shared_expert_intermediate_size"][1],
                                                 description="Qwen2-MoE's shared expert, which every token runs through; 0 = none")
    dense_layers: int = Field(0, ge=0, le=SHAPE_BOUNDS["num_layers"][1], description=(
        "layers with a dense MLP of `intermediate_size` instead of experts (Qwen-MoE's `mlp_only_layers`, "
        "`decoder_sparse_step`); fewer than `num_layers`"))

    @model_validator(mode="after")
    def _heads(self) -> "ModelShapeTable":
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({kv}): each KV head serves a whole group "
                             "of query heads. HINT: copy num_attention_heads and num_key_value_heads from the model's config.json")
        if self.head_dim is None and self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) does not divide by heads ({self.heads}): set head_dim as the "
                             "model's config.json has it. HINT: copy head_dim from the model's config.json")
        return self

    @model_validator(mode="after")
    def _experts(self) -> "ModelShapeTable":
        moe_keys = [k for k in ("experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size", "dense_layers")
                    if getattr(self, k)]
        if not self.experts and moe_keys:
            raise ValueError(f"{', '.join(moe_keys)} describe experts, but experts = 0 (a dense model). HINT: set experts to "
                             "the model's num_experts (Mixtral: num_local_experts), or drop them")
        if self.experts and not self.experts_per_token:
            raise ValueError(f"experts = {self.experts} needs experts_per_token: the estimate counts the experts a token runs "
                             "through. HINT: copy num_experts_per_tok from the model's config.json")
        if self.experts_per_token and self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) is more than the {self.experts} experts. "
                             "HINT: copy num_experts and num_experts_per_tok from the model's config.json")
        if self.dense_layers >= self.num_layers and self.experts:
            raise ValueError(f"dense_layers ({self.dense_layers}) leaves none of the {self.num_layers} layers with experts. "
                             "HINT: count the layers of mlp_only_layers (and those decoder_sparse_step skips)")
        return self

    def shape(self) -> ModelShape:
        return ModelShape(self.hidden_size, self.num_layers, self.heads, self.kv_heads or self.heads, self.intermediate_size,
                          self.vocab_size, self.tie_word_embeddings, self.head_dim, source="train.model_shape",
                          model_type=self.model_type, num_experts=self.experts, experts_per_token=self.experts_per_token or 0,
                          moe_intermediate_size=self.moe_intermediate_size,
                          shared_expert_intermediate_size=self.shared_expert_intermediate_size, dense_layers=self.dense_layers)
