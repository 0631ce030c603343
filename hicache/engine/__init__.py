"""The reference engine: a tiny hybrid model and a scheduler that uses the cache."""

from hicache.engine.config import DEFAULT_KINDS, ModelConfig, mamba_dims, tiny_hybrid_layout
from hicache.engine.model import (
    ChunkOutput,
    HybridModel,
    MambaSnapshot,
    SequenceChunk,
    TinyHybrid,
    page_boundaries,
    tiny_hybrid,
)
from hicache.engine.reference import Generation, generate
from hicache.engine.scheduler import (
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
    "RequestResult",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SequenceChunk",
    "TinyHybrid",
    "generate",
    "mamba_dims",
    "page_boundaries",
    "tiny_hybrid",
    "tiny_hybrid_layout",
]
