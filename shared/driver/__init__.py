"""The driver: plan cells, run them on Ray, collect typed records (application)."""
