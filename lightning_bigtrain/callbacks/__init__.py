"""Lightning callbacks of lightning_bigtrain."""

from lightning_bigtrain.callbacks.distillation import DistillationOptions, KnowledgeDistillation
from lightning_bigtrain.callbacks.report import RunReport, format_report

__all__ = ["DistillationOptions", "KnowledgeDistillation", "RunReport", "format_report"]
