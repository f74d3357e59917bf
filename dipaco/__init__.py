"""dipaco: a trainer for DiPaCo (Distributed Path Composition) language models.

Data flow, one sub-package a stage: data (corpus, tokens) -> route (paths of documents, shards)
-> model (paths from a bank of modules) -> train (inner loops) -> sync (outer steps, over comm)
-> checkpoint -> eval / serve.
"""

__version__ = "0.1.0"
