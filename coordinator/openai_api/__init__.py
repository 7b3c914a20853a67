"""The OpenAI-compatible HTTP front: chat and text completions (streamed as server-sent events), models, health and
metrics over HTTP, translated to the Coordinator's own request path (docs/architecture.md, "The HTTP front")."""
