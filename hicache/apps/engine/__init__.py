"""The reference engine: a tiny hybrid model and a scheduler that uses the cache."""

from hicache.apps.engine.config import DEFAULT_KINDS, ModelConfig, mamba_dims, tiny_hybrid_layout
from hicache.apps.engine.demo_report import PhaseReport, phase_table
from hicache.apps.engine.model import (
    ChunkOutput,
    HybridModel,
    MambaSnapshot,
    SequenceChunk,
    TinyHybrid,
    page_boundaries,
    tiny_hybrid,
)
from hicache.apps.engine.reference import Generation, generate
from hicache.apps.engine.scheduler import (
    GenerationRequest,
    RequestResult,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
)

__all__ = [
    "DEFAULT_KINDS",
    "ChunkOutput",
    "Generation",
    "GenerationRequest",
    "HybridModel",
    "MambaSnapshot",
    "ModelConfig",
    "PhaseReport",
    "RequestResult",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SequenceChunk",
    "TinyHybrid",
    "generate",
    "mamba_dims",
    "page_boundaries",
    "phase_table",
    "tiny_hybrid",
    "tiny_hybrid_layout",
]
