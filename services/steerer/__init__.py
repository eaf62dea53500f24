"""Steerer service (issue 5): DiffMean steering vectors, alpha-scaled hooks, transformers and vLLM backends."""
