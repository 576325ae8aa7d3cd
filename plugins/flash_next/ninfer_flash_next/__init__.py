"""NInfer model family plugin for Qwen3.8-Flash-Next (Hugging Face model_type qwen4_exp)."""
