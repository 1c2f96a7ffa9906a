"""The memory and communication planner behind ``bigtrain plan``."""

from lightning_bigtrain.planning.planner import (
    STRATEGIES,
    Plan,
    PlanRow,
    parse_bandwidth,
    parse_bytes,
    plan,
    zero_paper_bytes,
)

__all__ = ["STRATEGIES", "Plan", "PlanRow", "parse_bandwidth", "parse_bytes", "plan", "zero_paper_bytes"]
