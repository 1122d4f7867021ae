"""Patching torch: the casting wrappers, the cast itself, the patch registry and the
torch-function modes that see every op."""
