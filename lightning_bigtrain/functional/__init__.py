"""The techniques as plain functions on tensors and modules (torch only, never lightning)."""

from lightning_bigtrain.functional.memory import model_state_bytes, peak_memory_bytes, tensor_bytes

__all__ = ["model_state_bytes", "peak_memory_bytes", "tensor_bytes"]
