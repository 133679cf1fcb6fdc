"""Lowering: extract partitions into sub-programs, preprocess them, splice delegates back."""
