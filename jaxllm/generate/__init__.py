"""Generation with a KV cache on the training mesh: `generate(params, cfg, prompts, max_new_tokens, on=...)`.

`cache.py` lays out the KV cache, `sampling.py` picks tokens, `decode.py` is the compiled prefill +
decode program and its host side.
"""

from jaxllm.generate.decode import Completion, generate, generate_arrays

__all__ = ["Completion", "generate", "generate_arrays"]
