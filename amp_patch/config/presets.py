"""The opt levels, as data: what each one sets, in Apex's names.

| level | cast_model_type | patch_torch_functions | keep_batchnorm_fp32 | master_weights | loss_scale |
|-------|-----------------|-----------------------|---------------------|----------------|------------|
| O0    | float32         | False                 | None                | False          | 1.0        |
| O1    | None            | True                  | None                | False          | dynamic    |
| O2    | half            | False                 | True                | True           | dynamic    |
| O3    | half            | False                 | False               | False          | 1.0        |
| O4    | None (BF16 O1)  | True                  | None                | False          | dynamic    |
| O5    | half (BF16 O2)  | False                 | True                | True           | dynamic    |
| O6    | half (O5 + FP8) | False                 | True                | True           | dynamic    |
| O7    | half (O5 + FP8) | False                 | True                | True           | dynamic    |

``readme_table()`` writes the README's form of it (a test holds the README to
it). "half" is the
run's half dtype (``config.parse`` resolves it); a dynamic loss scale becomes
1.0 under BF16, whose range is FP32's.

O6 and O7 are O5 with FP8 (``fp8``): O6 computes the model's ``nn.Linear``
layers in FP8 through torchao's float8 training (``precision.fp8``), O7 also
keeps Adam's moments in FP8/BF16 (``precision.lowstate``); MS-AMP's O1 and O2.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple, Union

#: placeholder for the run's half dtype in ``cast_model_type``
HALF = "half"


@dataclasses.dataclass(frozen=True)
class Preset:
    """What one opt level sets, before overrides."""

    level: str
    #: None: the model keeps its dtypes; "float32"; or ``HALF``
    cast_model_type: Optional[str]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    loss_scale: Union[str, float]
    #: the BF16 forms of O1/O2 (the ROCm fork's O4/O5): BF16 unless a call names FP16
    bf16: bool
    #: a few words on what it does, for ``--help``, the banner and the README
    does: str
    #: the default ``cast_policy``: the half models (O2/O3/O5) take the fastest
    #: correct choice ("auto": attention in FP32 where that is faster here, so O3,
    #: which keeps no masters, is not slower than O2), O1/O4 cast as
    #: ``torch.autocast`` does
    cast_policy: str = "parity"
    #: FP8 on top of O5: 0 none, 1 ``nn.Linear`` GEMMs in FP8 (O6), 2 and Adam's
    #: moments in FP8/BF16 (O7)
    fp8: int = 0

    @property
    def casts_model(self) -> bool:
        """Needs the model: works by casting it to the half dtype."""
        return self.cast_model_type == HALF


PRESETS: Dict[str, Preset] = {p.level: p for p in (
    Preset("O0", "float32", False, None, False, 1.0, False, "FP32, nothing cast"),
    Preset("O1", None, True, None, False, "dynamic", False, "torch functions cast"),
    Preset("O2", HALF, False, True, True, "dynamic", False, "model cast, FP32 master weights", "auto"),
    Preset("O3", HALF, False, False, False, 1.0, False, "model cast, no master weights", "auto"),
    Preset("O4", None, True, None, False, "dynamic", True, "torch functions cast"),
    Preset("O5", HALF, False, True, True, "dynamic", True, "model cast, FP32 master weights", "auto"),
    Preset("O6", HALF, False, True, True, "dynamic", True, "O5 with nn.Linear GEMMs in FP8 (torchao)", "auto", 1),
    Preset("O7", HALF, False, True, True, "dynamic", True, "O6 with Adam's moments in FP8/BF16", "auto", 2),
)}

OPT_LEVELS: Tuple[str, ...] = tuple(PRESETS)
#: levels that patch functions and need no model (the launcher starts them up front)
FUNCTION_LEVELS: Tuple[str, ...] = tuple(lv for lv, p in PRESETS.items() if p.patch_torch_functions)
#: levels that cast the model (the launcher attaches them at the model's optimizer)
MODEL_LEVELS: Tuple[str, ...] = tuple(lv for lv, p in PRESETS.items() if p.casts_model)


def readme_table() -> str:
    """The levels as the README's "Opt levels" table (a test holds the README to it)."""
    rows = ["| level | model | functions patched | batchnorm | master weights | loss scale |", "|---|---|---|---|---|---|"]
    for p in PRESETS.values():
        model = ("BF16" if p.bf16 else "half") if p.casts_model else "FP32"
        model += ", nn.Linear in FP8" if p.fp8 else ""
        functions = ("yes, BF16" if p.bf16 else "yes (FP16 on CUDA, BF16 on CPU)") if p.patch_torch_functions else "no"
        norm = {None: "\u2014", True: "FP32", False: "half"}[p.keep_batchnorm_fp32]
        masters = "FP32 masters in the optimizer" if p.master_weights else "no"
        masters += "; Adam's moments FP8/BF16" if p.fp8 > 1 else ""
        scale = ("1.0" if p.bf16 else "dynamic (1.0 for BF16)") if p.loss_scale == "dynamic" else f"{p.loss_scale}"
        rows.append(f"| {p.level} | {model} | {functions} | {norm} | {masters} | {scale} |")
    return "\n".join(rows)
