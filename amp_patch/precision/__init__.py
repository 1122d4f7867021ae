"""Half-precision models: O2/O3/O5 conversion, FP32 master weights, copies of a
converted model, and what amp_patch refuses to convert."""
