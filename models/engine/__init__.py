"""The ``LLM`` engine, one concept a module.

``llm`` the facade (construction, ``generate`` / ``chat`` / ``generate_stream`` / ``run``, a step's forward);
``prompts`` what a caller may pass as prompts; ``engine_loop`` callers on several threads taking turns at
one engine's steps; ``scheduler`` admission, chunked prefill and the decode-first batching loop;
``input_batch`` the persistent step buffers and their staging; ``graphs`` the CUDA graphs and the padding
they ask for; ``sampling`` each sequence's sampler and the async tokens' way to the host;
``request_sampler`` per-request ``SamplingParams`` sampling on the device; ``detokenizer`` incremental text
and stop strings; ``sequence`` a sequence's state; ``request`` a text-way request for a caller that runs
the engine itself (the server); ``outputs`` ``RequestOutput``; ``stats``
``GenerateStats``; ``kv_cache`` the paged KV cache and its block allocator.
"""

from .llm import LLM
from .outputs import RequestOutput
from .stats import GenerateStats

__all__ = ["GenerateStats", "LLM", "RequestOutput"]
