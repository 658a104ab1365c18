"""The KV cache: where a sequence's keys and values live between forwards.

``kv_cache.py`` holds the two layouts a model's forward writes to: **slots** (a row of
``max_model_len`` positions per sequence) and **paged** (fixed-size blocks from a shared pool,
a block table per sequence, full blocks of committed tokens kept for **prefix caching**).
``kv_manager.py`` is the paged layout's bookkeeping (tables, reservations, prefix matches,
copy-on-write forks) and ``block_pool.py`` the pool and its LRU of cached blocks. Nothing here
runs a model: the runtime (``runtime/``) reads and writes these tensors.
"""
