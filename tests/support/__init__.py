"""Helpers every test package shares: the one stub vLLM node (``vllm_stub``) and the one way to
wait for a condition (``waiting``)."""
