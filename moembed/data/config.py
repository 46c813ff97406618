"""Typed, validated settings of training data: where each source is and how records are read, and how sources
are mixed. `moembed.train.config.TrainConfig` holds them as its `data` and `sampler` sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceConfig(_Strict):
    """One data source. A batch is always drawn from a single source (nomic-embed-v1 §4.2.2)."""

    path: str
    format: Literal["jsonl", "parquet", "hf-disk"] = "jsonl"
    name: str | None = None  # defaults to the file name (plus `lang` when given)
    lang: str | None = None
    query_field: str = "query"
    document_field: str = "document"
    negatives_field: str | None = "negatives"
    text_field: str = "text"  # MLM stage: the field holding raw text (a bare JSON string also works)
    query_prefix: str = ""
    document_prefix: str = ""
    weight: float = Field(1.0, gt=0)  # multiplies the source size in the sampling formula
    size: int | None = Field(None, ge=1)  # records; counted from the file when absent
    # Records are read in blocks of this many consecutive records, each block emitted in a seeded random order
    # (0: file order). Files sorted by topic otherwise give batches of near-duplicates (easy or false in-batch
    # negatives). 10,000 is ~40x a finetuning batch (256) and more than half a pretraining one (16,384), so a
    # batch spans at most ~2 blocks, while one block of raw records per source stays small in memory (about
    # 10 MB at 1 KB a record) and resume re-reads at most one block.
    shuffle_block: int = Field(10_000, ge=0)

    @property
    def label(self) -> str:
        base = self.name or Path(self.path).stem
        return f"{base}.{self.lang}" if self.lang and not self.name else base


class SamplerConfig(_Strict):
    """p(source i) = (w_i · n_i)^(1/temperature) / Σ_j (w_j · n_j)^(1/temperature).

    `alpha` is the same written as an exponent, p_i ∝ (w_i · n_i)^α (nomic-embed-v2 Table 2 samples languages with
    α = 0.3): giving it sets temperature = 1/α; giving both requires they agree."""

    temperature: float = Field(1.0, gt=0)
    alpha: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _alpha_sets_temperature(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("alpha") is not None:
            alpha = float(data["alpha"])
            if alpha > 0 and "temperature" in data and abs(float(data["temperature"]) * alpha - 1) > 1e-9:
                raise ValueError(f"alpha ({alpha}) and temperature ({data['temperature']}) disagree: "
                                 "temperature must be 1/alpha; give only one of them")
            if alpha > 0:
                data = {**data, "temperature": 1.0 / alpha}
        return data
