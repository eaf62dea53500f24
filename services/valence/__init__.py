"""Valence bias between two checkpoints, and the fine-tuning demo (a service of its own)."""
