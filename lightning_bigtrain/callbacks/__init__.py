"""Lightning callbacks of lightning_bigtrain."""

from lightning_bigtrain.callbacks.report import RunReport, format_report

__all__ = ["RunReport", "format_report"]
