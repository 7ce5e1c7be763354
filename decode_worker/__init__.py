"""The decode pool: replicas that pull a prompt's KV (or prefill it) and stream tokens."""
