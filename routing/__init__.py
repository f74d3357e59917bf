"""Document routing for DiPaCo: features in, path assignments out.

- featurize:      LM-prefix features (DiPaCo) and TF-IDF + SVD features (c-BTM)
- kmeans:         k-means (torch), balanced and product k-means, mixed-radix path numbers
- assignment:     capacity-constrained assignment solved exactly as a min-cost flow
- arrange:        which cluster becomes which path, so alike clusters share a grid's modules
- router:         the Router artifact (safetensors + JSON): assign / scores for new documents
- discriminative: DiPaCo's discriminative re-routing classifier with size-matching biases
- quality:        shard sizes and agreement with labels (NMI, ARI, purity)

This package never imports :mod:`dipaco`; the trainer calls it, not the other way round.
"""
