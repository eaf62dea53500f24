"""CE-Bench: contrastive story pairs, SAE features and their scores (a service of its own)."""
