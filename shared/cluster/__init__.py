"""cluster-up / cluster-down: a local Ray head, the Serve app and an S3 server (application)."""
