"""The rules that keep speculation exact, on tensors and token ids alone: sampling parameters, the rejection and
coupled rules, seeded draws, batched row sampling, the round judge, the draft's sampler, prompt lookup and the
speculation counts. Imports `common` only: no model, no KV cache, no gRPC."""
