"""How a packed step's attention reads the paged KV pool: the SDPA backend, FlexAttention with its block-mask
layout, the compiled CPU kernel (`csrc/`), and which backend a model gets (`selection.py`)."""
