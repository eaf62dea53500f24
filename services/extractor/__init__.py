"""Extractor service: load any HF model (or the embedded one), run one forward per batch, capture hook points."""
