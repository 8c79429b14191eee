"""GPU memory from GGUF headers: the range reader (gguf.py), the plan (memory.py), and what llama-server
says it allocated (allocations.py)."""
