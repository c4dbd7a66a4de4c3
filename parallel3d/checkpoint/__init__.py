"""Checkpoints: sharded safetensors + JSON metadata (no pickle), loadable under any layout."""
