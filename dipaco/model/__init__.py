"""Paths and modules: the topology (levels, modules, path arithmetic), the HF Llama a path is, the ModuleBank
that holds every module once, the pretrained dense model, and scoring documents with a model."""
