"""Prober service: D1, grouped cross-validated probe AUROC with bootstrap confidence intervals."""
