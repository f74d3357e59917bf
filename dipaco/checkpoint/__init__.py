"""Checkpoints: the atomic, verified store (store) and the one reader of a trained experiment (experiment)."""
