"""Generated protobuf and gRPC stubs of protos/specdec/v1 (run `python -m specdec.protogen`)."""
