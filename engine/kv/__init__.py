"""KV block accounting: block pools, per-request block tables and the prefix cache index. Ids and
reference counts only, no tensors (those are engine/model/kv_cache.py). Standard library only."""
