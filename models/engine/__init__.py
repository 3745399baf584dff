"""The ``LLM`` engine, one concept a module.

``llm`` the facade (construction, ``generate``, ``run``, a step's forward); ``scheduler`` admission,
chunked prefill and the decode-first batching loop; ``input_batch`` the persistent step buffers and their
staging; ``graphs`` the CUDA graphs and the padding they ask for; ``sampling`` greedy / top-k sampling and
the async tokens' way to the host; ``sequence`` a sequence's state; ``stats`` ``GenerateStats``; ``kv_cache`` the paged KV cache and its
block allocator.
"""

from .llm import LLM
from .stats import GenerateStats

__all__ = ["GenerateStats", "LLM"]
