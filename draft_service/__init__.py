"""The draft service: proposes γ tokens per round from a small model or a model-free drafter."""
