"""Benchmark evaluation as lm-evaluation-harness 0.4 does it (`jaxllm eval`): task files (`tasks.py`), requests
(`requests.py`), log-likelihoods on the training mesh (`score.py`), metrics (`metrics.py`), a task run (`run.py`)."""
