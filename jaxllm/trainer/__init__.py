"""The trainer: the step, the loop, checkpoints, metrics. (`jaxllm.train(config)` is the API's, `jaxllm/api.py`.)"""
