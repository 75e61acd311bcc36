"""jaxllm: a JAX/XLA trainer for LLMs where every parallelism is sharding over one named mesh.

The Python API (`jaxllm/api.py`): `jaxllm.load(source)` a trained model, `jaxllm.train(config)`. Importing
`jaxllm` loads nothing else: the API's modules load when first used, so `jaxllm --help` does not start JAX.
"""

_API = ("load", "train", "import_hf", "Model", "RunResult", "Generation", "Evaluation")
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        from jaxllm import api

        return getattr(api, name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
