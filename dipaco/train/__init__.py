"""Training: the trainer (start-up, resume, checkpoints, metrics) with its two schedulers, lock-step rounds
(rounds) and the asynchronous task queue on Ray (tasks); EM re-sharding, discriminative re-routing and
pretraining."""
