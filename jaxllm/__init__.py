"""jaxllm: a JAX/XLA trainer for LLMs where every parallelism is sharding over one named mesh."""
