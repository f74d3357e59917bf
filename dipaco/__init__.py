"""dipaco: a trainer for DiPaCo (Distributed Path Composition) language models.

Data flow: corpus -> tokenizer -> shards -> paths (inner loop) -> outer step -> checkpoint -> eval/serve.
"""

__version__ = "0.1.0"
