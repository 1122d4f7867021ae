"""Stands in for ``apex.fp16_utils``, which current Apex no longer ships: the
hand-made FP16 training of 2018 scripts (``network_to_half``,
``FP16_Optimizer``, the loss scalers, the manual master-weight helpers),
with Apex's submodules, names, arguments and defaults.

``FP16_Optimizer`` runs on amp_patch's O2 pieces (FP32 master weights, the loss
scaler) without ``amp_patch.initialize``, and never patches torch.
"""
from __future__ import annotations

from . import fp16_optimizer, fp16util, loss_scaler
from .fp16_optimizer import FP16_Module, FP16_Optimizer, fp16_to_fp32, fp32_to_fp16
from .fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Module",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "fp16_to_fp32",
    "fp32_to_fp16",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
    # Apex's package had no __all__, so `from apex.fp16_utils import *` bound
    # its submodules too
    "fp16_optimizer",
    "fp16util",
    "loss_scaler",
]
