"""A test-only stand-in for the one vLLM function SGLang's RoPE falls back to on a CPU-only torch build.

On ``PYTHONPATH`` of the real-server tests only (tests/sglang/realserver.py), never installed: SGLang's
``RotaryEmbedding.__init__`` imports ``vllm._custom_ops.rotary_embedding`` where the torch build is CUDA's but
no GPU is present.
"""
