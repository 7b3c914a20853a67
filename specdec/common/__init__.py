"""What every room of the core builds on: the domain errors the services raise (one gRPC status each, mapped in
specdec/serving/grpc_errors.py) and the typed settings reader (flags, then environment, then defaults). Imports no
other room."""
