"""Paged KV cache bookkeeping: block pool, prefix cache and the manager that ties them together."""
