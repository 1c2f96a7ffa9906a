"""Lightning callbacks of lightning_bigtrain."""

from lightning_bigtrain.callbacks._pruning_schedule import PruningSchedule
from lightning_bigtrain.callbacks.augmentation import BatchAugmentation
from lightning_bigtrain.callbacks.distillation import DistillationOptions, KnowledgeDistillation
from lightning_bigtrain.callbacks.fault_tolerance import EXIT_PREEMPTED, FaultTolerance, Preempted
from lightning_bigtrain.callbacks.fusion import OperatorFusion
from lightning_bigtrain.callbacks.magnitude_pruning import MagnitudePruning, format_sparsity_table
from lightning_bigtrain.callbacks.report import RunReport, format_report
from lightning_bigtrain.callbacks.structured_pruning import StructuredPruning, load_pruned

__all__ = [
    "EXIT_PREEMPTED",
    "BatchAugmentation",
    "DistillationOptions",
    "FaultTolerance",
    "KnowledgeDistillation",
    "MagnitudePruning",
    "OperatorFusion",
    "Preempted",
    "PruningSchedule",
    "RunReport",
    "StructuredPruning",
    "format_report",
    "format_sparsity_table",
    "load_pruned",
]
