"""The prefill pool: replicas that compute a prompt to its first token and hand its KV blocks over."""
