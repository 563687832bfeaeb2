"""output.dedup's typed section: the methods and their options, validated once with the config, and the folders a
deduplicated run commits."""

from __future__ import annotations

from typing import Literal

import pydantic

from docbeam.pipeline.sinks.registry import SinkSection

DUPLICATES = "duplicates"  # one row per marked document: id, duplicate_of, kind, similarity
# The values the report's sweep counts documents at (a semantic eps, a near threshold)
SEMANTIC_SWEEP = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2)
NEAR_SWEEP = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
INDEX = "dedup_index"
MAX_PERMUTATIONS = 1024  # every kept document's exact key, signature and vector: what the next run compares against


class Options(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_yaml(cls, value):
        return {} if value is True else None if value is False else value

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value, info):
        """``threshold: true`` is a typo, not 1.0 (pydantic reads a bool as a number)."""
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name} takes a number or a word, not {str(value).lower()}")
        return value


class NearOptions(Options):
    """MinHash LSH over word n-grams: ``bands`` × ``rows`` permutations; a pair sharing a band is a candidate,
    marked when its estimated Jaccard is at least ``threshold`` (FineWeb: 5-grams, 14 bands of 8)."""

    threshold: float = pydantic.Field(0.8, gt=0.0, le=1.0)
    ngram: int = pydantic.Field(5, ge=1, le=32)
    bands: int = pydantic.Field(14, ge=1, le=512)
    rows: int = pydantic.Field(8, ge=1, le=64)

    @pydantic.model_validator(mode="after")
    def _permutations_bounded(self):
        if self.bands * self.rows > MAX_PERMUTATIONS:
            raise ValueError(
                f"near: bands × rows is {self.bands * self.rows} permutations, more than {MAX_PERMUTATIONS} (each "
                "document's signature holds one 4-byte value per permutation); FineWeb uses 14 × 8 = 112"
            )
        return self

    def scheme(self) -> str:
        """What a stored signature was made with: an earlier run's of another scheme is not compared."""
        from docbeam.pipeline.sinks.dedup.signatures import SEED

        return f"minhash/words/ngram={self.ngram}/perm={self.bands * self.rows}/seed={SEED}"


class SemanticOptions(Options):
    """SemDeDup over the run's own vectors: k-means (``clusters``: a number, or ``auto`` for about half of
    ``max_cluster`` per cluster), then in each cluster a document whose cosine to a kept one is at least 1 − ``eps``
    is marked; ``keep``: hard (those far from the centroid are kept), easy (central ones) or random."""

    eps: float = pydantic.Field(0.05, gt=0.0, lt=1.0)
    clusters: Literal["auto"] | pydantic.PositiveInt = "auto"
    keep: Literal["hard", "easy", "random"] = "hard"
    max_cluster: int = pydantic.Field(2000, ge=2, le=20_000)  # its cosines: max_cluster² float32 (1.6 GB at 20k)
    seed: int = pydantic.Field(0, ge=0, lt=2**32)


class DedupConfig(SinkSection):
    """``output.dedup``: any of the three methods; ``true`` is exact and near with their defaults."""

    exact: pydantic.StrictBool = False
    near: NearOptions | None = None
    semantic: SemanticOptions | None = None
    # also against what earlier runs kept that today's input no longer holds (a job whose input is each day's new
    # documents); off, an incremental run's input is the corpus, as for the sinks' removals
    history: pydantic.StrictBool = False

    @classmethod
    def from_yaml(cls, value):
        if value is True:
            return {"exact": True, "near": {}}
        if value is False:
            return None
        if isinstance(value, dict):
            return {k: NearOptions.from_yaml(v) if k in ("near", "semantic") else v for k, v in value.items()}
        return value

    @pydantic.model_validator(mode="after")
    def _a_method(self):
        if not (self.exact or self.near or self.semantic):
            raise ValueError(
                "output.dedup names no method; set exact: true, near: {threshold: 0.8} or semantic: {eps: 0.05} "
                "(or output.dedup: true for exact and near)"
            )
        return self

    def fits(self, job) -> None:
        if self.semantic is not None and job.output.vector_dtype not in ("float32", "float16"):
            raise ValueError(
                f"output.dedup.semantic compares the run's vectors as floats, but output.vector_dtype is "
                f"{job.output.vector_dtype}; set output.vector_dtype: float32 (or float16), or drop semantic"
            )
        if job.output.granularity == "chunk":
            raise ValueError(
                "output.dedup marks documents, and output.granularity: chunk writes no document rows; set "
                "output.granularity: document or both"
            )
        skipping = [k for k in type(job.output).model_fields if getattr(getattr(job.output, k), "skip_duplicates", 0)]
        if self.history and skipping:
            raise ValueError(
                f"output.dedup.history marks documents against earlier ones the output no longer holds, which "
                f"output.{skipping[0]}.skip_duplicates would then remove from the sink with their copy; drop one"
            )
