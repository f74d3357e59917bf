"""Evaluation: per-path perplexity after the routing prefix, and test-time re-routing."""
