"""The one Ray Serve / FastAPI application that serves PoolBench over HTTP (application)."""
