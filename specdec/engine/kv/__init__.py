"""The paged KV cache: fixed-size blocks shared between sequences, the pool that holds them, a session's cache on
it, the budget that sizes it and the admission that waits for free blocks."""
