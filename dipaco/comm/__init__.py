"""Communication that knows no algorithm: the ranks (world), which rank trains which paths (placement),
process groups per set of module holders, codecs, the reduce transport (start/wait), error feedback and byte
accounting."""
