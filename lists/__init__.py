"""Default op lists of amp_patch, shipped as package data (``amp_patch.lists``)."""
