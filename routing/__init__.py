"""Document routing for DiPaCo: features in, path assignments out.

This package never imports :mod:`dipaco`; the trainer calls it, not the other way round.
"""
