"""The shared core of the three services, in rooms (docs/architecture.md, "The core's rooms"):

- `common/`: the domain errors and the typed settings reader every room builds on;
- `engine/`: models and how they run: loading, the paged KV cache, packed passes, attention, CUDA graphs, batching;
- `sampling/`: the rules that keep speculation exact, on tensors and ids alone;
- `decoding/`: a round on a session's cache: drafting a block, verifying it, the in-process reference loop;
- `telemetry/`: metrics and traces;
- `serving/`: what turns a service object into a gRPC server: start-up, errors, TLS, sessions, the wire format;
- `v1/`: the generated stubs of protos/specdec/v1.

On top, what a user imports or runs: `client`, `cli` (`python -m specdec`), `local_stack` with its `redis_server`,
and `protogen`, which regenerates `v1/`.
"""
