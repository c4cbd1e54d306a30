"""The ``[parallel]`` table (how each model replica is split across ranks) and ``train.model_shape`` (the
shape of a hub model that is not on disk, for the memory estimate and the head rules).

Degrees only here; the rules that need the world size, the ZeRO stage or the model's heads run in
``plan`` (``sizing.layout``), where every problem is reported at once. Later rounds add pipeline and
expert degrees as keys of this table; unknown keys are refused like everywhere else.
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

    def shape(self) -> ModelShape:
        return ModelShape(self.hidden_size, self.num_layers, self.heads, self.kv_heads or self.heads, self.intermediate_size,
                          self.vocab_size, self.tie_word_embeddings, self.head_dim, source="train.model_shape",
                          model_type=self.model_type)
