"""The corpus in the PoolBench layout: passages, loading, validation, and the embedded generator (library)."""
