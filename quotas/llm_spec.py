"""The ``llm`` section of a ``kind: llm`` model: the objectives the LLM rules steer by."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

LLM_ENGINES = ("tiny-llama",)  # kind: llm engines (gpubroker.deployments.llm)


class LlmSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    expected_peak_concurrency: int = Field(
        8,
        ge=1,
        le=4096,
        description="Sequences in flight at the expected peak; max_num_seqs starts at half of it, within memory.",
    )
    ttft_slo_ms: float = Field(
        2000.0, gt=0, le=600_000, description="Time-to-first-token P95 objective in milliseconds."
    )
    tpot_slo_ms: float = Field(
        200.0, gt=0, le=60_000, description="Time-per-output-token P95 objective in milliseconds."
    )
