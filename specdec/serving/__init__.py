"""What turns a service object into a gRPC server: start-up with health and reflection, the one place domain errors
become statuses, interceptors for traces and RPC metrics, TLS, the session store with its limits, channel options,
and the wire format of tensors and sampling settings. May use every other room."""
