"""Typed, validated settings of the contrastive objective (errors name the key)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossConfig(BaseModel):
    """InfoNCE with in-batch and hard negatives, optional Matryoshka prefixes and MoE auxiliary losses.

    temperature: τ in nomic-embed-v1 Eq. 1 (scale = 1/τ; 0.02 ⇔ scale 50).
    num_hard_negatives: H mined negatives per query (0: in-batch negatives only).
    symmetric: add the document→query term (nomic-embed-v1 Eq. 2) and average the two directions.
    mask_false_negatives: drop in-batch documents whose text equals the query's own positive.
    matryoshka_dims / matryoshka_weights: prefixes whose losses are summed with these weights (Kusupati et al.;
        nomic-embed-v2 §4: 768 and 256; arctic-embed-2: 256). None: the full dimension only.
    aux_loss_coef: α of the MoE load-balancing loss (nomic-embed-v2 Eq. 1, α = 1).
    balance_window: the steps over which that loss counts each expert's share of the routing, this one included:
        1, the step's own batch (nomic-embed-v2); W > 1, the last W steps' batches (global-batch balancing, Qiu et
        al. 2025, over steps: moembed.train.balance_window), so that one source per batch may go to its own experts.
    z_loss_coef: weight of the router z-loss (ST-MoE), 0 disables it.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(0.02, gt=0)
    num_hard_negatives: int = Field(0, ge=0)
    symmetric: bool = False
    mask_false_negatives: bool = True
    matryoshka_dims: list[int] | None = None
    matryoshka_weights: list[float] | None = None
    aux_loss_coef: float = Field(1.0, ge=0)
    balance_window: int = Field(1, ge=1)
    z_loss_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "LossConfig":
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if dims is not None:
            if not dims:
                raise ValueError("matryoshka_dims: must list at least one dimension (or be null)")
            if any(d <= 0 for d in dims):
                raise ValueError(f"matryoshka_dims: dimensions must be positive, got {dims}")
            if len(set(dims)) != len(dims):
                raise ValueError(f"matryoshka_dims: duplicate dimensions in {dims}")
        if weights is not None:
            if dims is None:
                raise ValueError("matryoshka_weights: given without matryoshka_dims")
            if len(weights) != len(dims):
                raise ValueError(
                    f"matryoshka_weights: {len(weights)} weights for {len(dims)} matryoshka_dims"
                )
            if any(w < 0 for w in weights):
                raise ValueError(f"matryoshka_weights: weights must be non-negative, got {weights}")
        return self

    def dims_and_weights(self, full_dim: int) -> tuple[list[int], list[float]]:
        """The prefixes to train and their weights; the full dimension alone when no Matryoshka dims are set."""
        if self.matryoshka_dims is None:
            return [full_dim], [1.0]
        weights = self.matryoshka_weights or [1.0] * len(self.matryoshka_dims)
        return list(self.matryoshka_dims), list(weights)
