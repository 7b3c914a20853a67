"""Models and how they run on a device: loading a model with its start-up self-test, the paged KV cache (`kv/`),
packed forward passes with their attention backends (`attention/`), bucketed steps replayed from CUDA graphs, the
CPU kernels, a model in a process of its own, step costs, and the step batcher that runs every session's model
work on one thread. Imports `common` only: no sampling rule, no gRPC."""
