"""Corpus in, token ids out: loading (corpus), the BPE tokenizer, the train/validation split (prepare),
packing, and id hashing."""
