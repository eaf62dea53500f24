"""PoolBench: which pooling strategy captures a concept in an LM's hidden states, and where."""

__version__ = "0.1.0"
