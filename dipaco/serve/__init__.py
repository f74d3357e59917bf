"""Inference: one routed path as a plain HF model (pipeline), HTTP serving, export to a standard HF
directory. Loads nothing of training (an import-linter contract)."""
