"""The interfaces that plugins implement. Each is one small ABC; see docs/ARCHITECTURE.md."""

from inferx_core.interfaces.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionLayer,
    MLAWeights,
    SplitAttention,
)
from inferx_core.interfaces.executor import (
    DecodeGraphs,
    DoneStep,
    Executor,
    MixedGraphs,
    PendingStep,
    StepResult,
)
from inferx_core.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher
from inferx_core.interfaces.kv import KVGroup, KVLayerSpec, KVManager, kv_groups
from inferx_core.interfaces.model import BuildContext, Checkpoint, CheckpointFormat, ModelArch
from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, QuantExperts, RouterSpec
from inferx_core.interfaces.ops import KernelOps
from inferx_core.interfaces.quant import LinearSpec, QuantConfig, QuantLinear, QuantScheme
from inferx_core.interfaces.scheduler import (
    QueueFullError,
    ScheduledChunk,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from inferx_core.interfaces.transport import Transport

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionLayer",
    "BuildContext",
    "Checkpoint",
    "CheckpointFormat",
    "DecodeGraphs",
    "DoneStep",
    "Executor",
    "ExpertsSpec",
    "ExpertWeights",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "KVGroup",
    "KVLayerSpec",
    "KVManager",
    "KernelOps",
    "MLAWeights",
    "MixedGraphs",
    "ModelArch",
    "LinearSpec",
    "PendingStep",
    "QuantConfig",
    "QuantExperts",
    "QuantLinear",
    "QuantScheme",
    "QueueFullError",
    "RouterSpec",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "SplitAttention",
    "StepResult",
    "Transport",
    "kv_groups",
]
