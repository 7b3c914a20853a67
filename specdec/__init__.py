"""Shared core for the speculative decoding services: sampling math, models, KV caches, config."""
