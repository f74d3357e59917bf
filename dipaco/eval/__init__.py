"""Evaluation: per-document scoring after the routing prefix, per-path perplexity, test-time re-routing."""
