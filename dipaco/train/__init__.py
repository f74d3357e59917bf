"""Training: the experiment (shards, paths, bank, sync), the round loop, each path's inner AdamW loop, sampler, LR schedule, pretraining, early stopping, placement of paths on ranks."""
