"""The lookahead branch on the paged KV cache: cache layouts, tree attention, start-up measurement."""
