"""jaxllm: a JAX/XLA trainer for LLMs where every parallelism is sharding over one named mesh.

The Python API (`jaxllm/api.py`): `jaxllm.load(source)` a trained model, `jaxllm.train(config)`. Importing
`jaxllm` loads nothing else (but `xla_flags`, which sets XLA's GPU flags on a GPU machine): the API's modules load
when first used, so `jaxllm --help` does not start JAX.
"""

from jaxllm.xla_flags import add_gpu_defaults

add_gpu_defaults()  # XLA's GPU flags, before JAX starts a backend (jaxllm/xla_flags.py)

_API = ("load", "train", "import_hf", "Model", "RunResult", "Generation", "Evaluation")
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        from jaxllm import api

        return getattr(api, name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
