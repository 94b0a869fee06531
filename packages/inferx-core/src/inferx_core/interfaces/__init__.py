"""The interfaces that plugins implement. Each is one small ABC; see docs/ARCHITECTURE.md."""

from inferx_core.interfaces.attention import AttentionBackend, AttentionBatch, SplitAttention
from inferx_core.interfaces.executor import DoneStep, Executor, PendingStep, StepResult
from inferx_core.interfaces.kv import KVLayerSpec, KVManager
from inferx_core.interfaces.model import BuildContext, Checkpoint, CheckpointFormat, ModelArch
from inferx_core.interfaces.ops import KernelOps
from inferx_core.interfaces.quant import QuantLinear, QuantScheme
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
    "BuildContext",
    "Checkpoint",
    "CheckpointFormat",
    "DoneStep",
    "Executor",
    "KVLayerSpec",
    "KVManager",
    "KernelOps",
    "ModelArch",
    "PendingStep",
    "QuantLinear",
    "QuantScheme",
    "QueueFullError",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "SplitAttention",
    "StepResult",
    "Transport",
]
