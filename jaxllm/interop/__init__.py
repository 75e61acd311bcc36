"""Models in and out of jaxllm: Hugging Face checkpoints (`hf.py`), their config.json (`hf_config.py`) and the
per-family tables of tensor names and layouts (`hf_tables.py`)."""
