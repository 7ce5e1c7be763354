"""What a replica of either pool is: one engine, its KV link, KV events for the router's index, routing and
autoscaling stats, Prometheus metrics. prefill_worker/ and decode_worker/ subclass EngineReplica."""
