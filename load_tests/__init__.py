"""Load tests: latency and throughput of the coordinator under concurrency, speculative vs plain.

    python -m load_tests --address 127.0.0.1:50051 --concurrency 1,2,4,8,16
    python -m load_tests --start-stack --concurrency 1,2,4 --rates 0.5,1

The parts: `prompts` (the prompt sets), `generator` (one timed streaming request and the closed-/open-loop
drivers), `sweep` (levels x prompt sets x modes, interleaved), `report` (figures per level, JSON/CSV,
the text summary), `plots` (PNGs), `cli` (flags, optional local stack).
"""
