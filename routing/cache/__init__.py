"""What each node has cached: the approximate prefix index, the precise index fed by vLLM's KV
events (``kv_events/``), the combined per-node index the proxy asks (``kv_aware_index``), and the
prompt's text and token ids they match on."""
