"""dipaco's benchmarks, one module each on one harness (:mod:`bench.harness`), run from the repository root as

    python -m bench NAME [args...]      # python -m bench NAME --help: its flags and documented commands
    python -m bench                     # the list below

codecs        encode + decode time of every outer-gradient codec, and the adaptive rule's cost
checkpoint    how long a round blocks on its checkpoint: background writer against synchronous (issue 48)
tokenize      prepare's encoder: HF tokenizers against tiktoken's engine on the same texts (issue 33)
async_sync    asynchronous DiPaCo on Ray against synchronous rounds, with slow workers (issue 13)
comm          multi-worker communication: bytes per round against DDP, outer-step time, codecs' quality (issues 4, 12)
quality       the paper's comparison table at this machine's scale: DiPaCo against dense, DiLoCo and flat MoE (issue 14)
path_scaling  validation perplexity against the number of paths P at a fixed path size (issues 36, 49)
serve         `dipaco serve`: a path against dense, HTTP load per batching mode, APIs, abuse, soak (issues 5, 47, 59, 61, 62)
routing       the routing package: k-means against scikit-learn, routing NMI of every featurizer on the shared corpora
corpus_scale  time, peak memory and disk of prepare, route and train as the corpus grows to 10M documents (issue 33)
throughput    one path's inner loop against the best hand-written loop: tokens/s, MFU, profile, round overhead (issue 48)
sites         DiPaCo and DiLoCo against a real DDP across network-namespace sites on shaped links (issue 72)
ray_sites     the Ray driver across two sites: bytes per path task over a site's link by ray.state_sync_every (issue 72)

No benchmark module imports another (import-linter checks it). Run them through ``python -m bench``; never
put bench/ itself on ``sys.path``: ``bench/tokenize.py`` and ``bench/codecs.py`` would shadow the standard
library's modules of those names, and ``bench/routing.py`` this repository's ``routing`` package.
"""

# name -> one-line summary: what `python -m bench` lists without importing any benchmark (nor torch).
BENCHMARKS: dict[str, str] = {
    "codecs": "encode + decode time of every outer-gradient codec, and the adaptive rule's cost",
    "checkpoint": "how long a round blocks on its checkpoint: background writer against synchronous (issue 48)",
    "tokenize": "prepare's encoder: HF tokenizers against tiktoken's engine on the same texts (issue 33)",
    "async_sync": "asynchronous DiPaCo on Ray against synchronous rounds, with slow workers (issue 13)",
    "comm": "multi-worker communication: bytes per round against DDP, outer-step time, codecs' quality (issues 4, 12)",
    "quality": "the paper's comparison table at this machine's scale: DiPaCo against dense, DiLoCo and flat MoE (issue 14)",
    "path_scaling": "validation perplexity against the number of paths P at a fixed path size (issues 36, 49)",
    "serve": "`dipaco serve`: a path against dense, HTTP load per batching mode, APIs, abuse, soak (issues 5, 47, 59, 61, 62)",
    "routing": "the routing package: k-means against scikit-learn, routing NMI of every featurizer on the shared corpora",
    "corpus_scale": "time, peak memory and disk of prepare, route and train as the corpus grows to 10M documents (issue 33)",
    "throughput": "one path's inner loop against the best hand-written loop: tokens/s, MFU, profile, round overhead (issue 48)",
    "sites": "DiPaCo and DiLoCo against a real DDP across network-namespace sites on shaped links (issue 72)",
    "ray_sites": "the Ray driver across two sites: bytes per path task over a site's link by ray.state_sync_every (issue 72)",
}
