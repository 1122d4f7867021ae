"""Stand-in for ``apex.multi_tensor_apply``: ``multi_tensor_applier``, Apex's
launcher with Apex's chunk size; its class is in the submodule of the same
name, as in Apex."""
from .multi_tensor_apply import MultiTensorApply

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

#: Apex's launcher, with Apex's chunk size
multi_tensor_applier = MultiTensorApply(2048 * 32)
