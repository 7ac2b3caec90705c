"""The paged-attention model runner: a real Llama / Qwen2-family model behind the scheduler.

Only this subpackage imports torch, and only its CUDA path imports triton. Modules:
``model_runner`` (the runner), ``input_batch`` (per-request state and packed inputs),
``attention`` (store-KV and varlen paged attention; ``triton_attention`` on CUDA),
``sampler``, ``cuda_graphs``, ``loader`` (model folders and built-in names),
``builder`` (seeded random-weight models), ``convert_gguf`` and ``models/``.
"""
