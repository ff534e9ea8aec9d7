"""Serving trained checkpoints: Ray Serve applications behind an OpenAI-compatible API."""
