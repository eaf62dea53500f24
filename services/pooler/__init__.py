"""Pooler service: strategies as data (StrategySpec), all strategies and layers pooled in one contraction."""
