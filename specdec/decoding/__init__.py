"""A round on a session's KV cache: drafting a block with the draft model, verifying it with the target, and the
in-process reference loop that chains them. Built from `engine` and `sampling`; never imports `serving`."""
