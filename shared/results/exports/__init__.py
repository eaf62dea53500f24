"""A finished run in other projects' formats, each a thin adapter over what the run stored: the community
submission, steering vectors (GGUF, safetensors, torch), `--log-samples`, and W&B / MLflow trackers."""
