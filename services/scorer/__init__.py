"""Scorer service (issue 5): classifier B, a fine-tuned MiniLM per concept that scores generations."""
