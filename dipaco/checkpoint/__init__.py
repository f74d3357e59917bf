"""Checkpoints: the atomic, verified store in one format (store), the stateful components of a training run
(state), and the one reader of a trained experiment (experiment)."""
