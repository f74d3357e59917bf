"""Communication that knows no algorithm: the world of ranks, process groups per module holder set, codecs, the reduce transport (start/wait), error feedback, byte accounting."""
