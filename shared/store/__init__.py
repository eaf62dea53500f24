"""Durable artifacts: content-addressed keys, Arrow tables, and the atomic local and S3 stores (library)."""
