"""The memory and communication planner behind ``bigtrain plan``."""

from lightning_bigtrain.planning.planner import (
    COMPRESSED_STRATEGIES,
    STRATEGIES,
    Cluster,
    Plan,
    PlanRow,
    Workload,
    parse_bandwidth,
    parse_bytes,
    plan,
    zero_paper_bytes,
)

__all__ = [
    "COMPRESSED_STRATEGIES",
    "STRATEGIES",
    "Cluster",
    "Plan",
    "PlanRow",
    "Workload",
    "parse_bandwidth",
    "parse_bytes",
    "plan",
    "zero_paper_bytes",
]
