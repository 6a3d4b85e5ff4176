"""Gradient accumulation: the large-batch equivalence experiment (``equivalence``) and the static check of
training scripts (``script_check``), behind ``vramledger accum-check``."""
