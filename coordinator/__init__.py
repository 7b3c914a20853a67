"""The client-facing coordinator: runs each request's draft -> verify -> commit rounds."""
