"""Models and how they run on a device: loading a model with its start-up self-test, the paged KV cache (`kv/`),
packed forward passes with their attention backends (`attention/`), bucketed steps replayed from CUDA graphs, the
CPU kernels, a model in a process of its own, step costs, the step batcher that runs every session's model work on
one thread, and the accelerator twin (`simulated/`), a model backend whose passes take a GPU's modelled time.
Imports `common` only: no sampling rule, no gRPC."""
