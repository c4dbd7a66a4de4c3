"""Offload: homes for training state off the accelerator (so far: activations saved for backward)."""
from parallel3d.offload.activations import ActivationOffload

__all__ = ["ActivationOffload"]
