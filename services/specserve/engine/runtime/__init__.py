"""The runtime: our own forward of a Llama-family decoder over the KV cache.

``model.py`` (:class:`~specserve.engine.runtime.model.LlamaRuntime`) runs a ragged batch
(``forward_batch.py``: what a forward takes and returns) through ``layers.py``, with the
attention context of ``forward_context.py`` (positions, token trees of ``token_tree.py``,
block tables), row groups packed into one pass (``grouped_forward.py``), and one of three
kernel sets: the C kernels of ``kernels.c`` (``native.py`` builds and loads them; row-invariant,
the CPU default), the library's (``kernels.py``; attention over blocks in
``block_attention.py``) or the compiled path (``compiled.py``: torch.compile and CUDA graphs).
``tp.py`` shards it for tensor parallelism; ``arch.py`` reads a checkpoint's architecture;
``malloc.py`` keeps freed memory from going back to the OS between steps.
"""
