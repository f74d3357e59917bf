"""A path trains: its inner AdamW loop, its shard sampler and LR schedule, and its early stopping."""
