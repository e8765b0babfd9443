"""Experiments that reproduce the paper's comparisons at small scale (`orthros experiment NAME`)."""
