"""Which Apex modules amp_patch serves, and what replaces the rest.

The data the ``apex`` alias (``amp_patch.frontends.alias``) answers imports
from, and the README's list of stand-ins is tested against.
"""
from __future__ import annotations

from typing import Dict

#: Apex's packages (and Apex's compiled extensions, which are top-level
#: modules) that amp_patch serves, and the module that stands in for each. A
#: submodule is the stand-in's submodule of the same name, so every module
#: path Apex had (``apex.optimizers.fused_adam``, ``apex.parallel.LARC``, ...)
#: imports in every form: ``import a.b.c as x``, ``from a.b import c``,
#: ``importlib.import_module``.
STANDINS: Dict[str, str] = {
    "apex.amp": "amp_patch.amp",
    "apex.parallel": "amp_patch.apex.parallel",
    "apex.fp16_utils": "amp_patch.apex.fp16_utils",
    "apex.optimizers": "amp_patch.apex.optimizers",
    "apex.normalization": "amp_patch.apex.normalization",
    "apex.multi_tensor_apply": "amp_patch.apex.multi_tensor_apply",
    "apex.contrib": "amp_patch.apex.contrib",
    "apex.mlp": "amp_patch.apex.mlp",
    "apex.fused_dense": "amp_patch.apex.fused_dense",
    "apex.reparameterization": "amp_patch.apex.reparameterization",
    # Apex's compiled extensions that scripts import themselves
    "amp_C": "amp_patch.apex.amp_C",
    "apex_C": "amp_patch.apex.apex_C",
    "fused_adam_cuda": "amp_patch.apex.fused_adam_cuda",
    "fused_layer_norm_cuda": "amp_patch.apex.fused_layer_norm_cuda",
    "fused_weight_gradient_mlp_cuda": "amp_patch.apex.fused_weight_gradient_mlp_cuda",
    "xentropy_cuda": "amp_patch.apex.xentropy_cuda",
}

#: what to use instead of the Apex modules (and extensions) amp_patch does not
#: serve; the longest matching prefix of a module's name applies
REPLACEMENTS: Dict[str, str] = {
    "apex.contrib": "the torch equivalents of the kernel you used (torch.nn.functional.scaled_dot_product_attention, "
    "torch.optim's fused optimizers, torch.nn.SyncBatchNorm; xentropy: torch.nn.functional.cross_entropy(logits, "
    "target, label_smoothing=...))",
    "apex.contrib.xentropy": "torch.nn.functional.cross_entropy(logits, target, label_smoothing=smoothing, "
    "ignore_index=padding_idx) (torch.nn.CrossEntropyLoss takes the same; SoftmaxCrossEntropyLoss.apply's "
    "half_to_float is not needed: amp_patch runs cross_entropy in FP32)",
    "apex.contrib.multihead_attn": "torch.nn.MultiheadAttention or torch.nn.functional.scaled_dot_product_attention",
    "apex.contrib.fmha": "torch.nn.functional.scaled_dot_product_attention",
    "apex.contrib.sparsity": "torch.ao.pruning (2:4 sparsity: torch.sparse.to_sparse_semi_structured)",
    "apex.contrib.focal_loss": "torchvision.ops.sigmoid_focal_loss",
    "apex.contrib.bottleneck": "torchvision.models.resnet.Bottleneck",
    "apex.contrib.groupbn": "torch.nn.BatchNorm2d (torch.nn.SyncBatchNorm across processes)",
    "apex.contrib.cudnn_gbn": "torch.nn.SyncBatchNorm",
    "apex.contrib.transducer": "torchaudio.functional.rnnt_loss",
    "apex.transformer": "torch.distributed.tensor.parallel (tensor parallelism) or Megatron-Core",
    "apex.RNN": "torch.nn.LSTM / torch.nn.GRU",
    "apex.amp": "amp_patch.amp's public API (apex.amp's internals are not served)",
    "apex.parallel.sync_batchnorm_kernel": "apex.parallel.SyncBatchNorm (served)",
    "apex.parallel.optimized_sync_batchnorm_kernel": "apex.parallel.SyncBatchNorm (served)",
    "syncbn": "apex.parallel.SyncBatchNorm (served) or torch.nn.SyncBatchNorm",
    "mlp_cuda": "apex.mlp.MLP (served) or a torch.nn.Sequential of nn.Linear",
    "fused_dense_cuda": "apex.fused_dense (served) or torch.nn.Linear",
    "fast_multihead_attn": "torch.nn.functional.scaled_dot_product_attention",
    "fmhalib": "torch.nn.functional.scaled_dot_product_attention",
    "scaled_masked_softmax_cuda": "torch.softmax on the masked scores (torch.compile fuses it)",
    "scaled_upper_triang_masked_softmax_cuda": "torch.nn.functional.scaled_dot_product_attention(is_causal=True)",
    "scaled_softmax_cuda": "torch.softmax(x * scale, dim=-1)",
    "generic_scaled_masked_softmax_cuda": "torch.softmax on the masked scores",
    "fused_rotary_positional_embedding": "a torch implementation of RoPE (torch.compile fuses it)",
    "fast_layer_norm": "apex.contrib.layer_norm.FastLayerNorm (served) or torch.nn.LayerNorm",
    "fused_lamb_cuda": "apex.optimizers.FusedLAMB (served)",
    "distributed_adam_cuda": "apex.contrib.optimizers.distributed_fused_adam (served)",
    "distributed_lamb_cuda": "apex.optimizers.FusedLAMB (served)",
    "group_norm_cuda": "apex.contrib.group_norm.GroupNorm (served) or torch.nn.GroupNorm",
    "focal_loss_cuda": "torchvision.ops.sigmoid_focal_loss",
    "bnp": "torch.nn.BatchNorm2d",
    "peer_memory_cuda": "torch.distributed's send / recv",
    "nccl_p2p_cuda": "torch.distributed's send / recv",
    "transducer_joint_cuda": "torchaudio.functional.rnnt_loss",
    "transducer_loss_cuda": "torchaudio.functional.rnnt_loss",
}
