"""Paths and modules: the topology (levels, modules, path arithmetic), the HF Llama a path is, and the ModuleBank that holds every module once."""
