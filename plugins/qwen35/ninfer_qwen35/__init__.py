"""NInfer model family plugin for Qwen3.5 / 3.6 / 3.8: Gated DeltaNet + gated attention, dense and MoE.

The hooks live in `ninfer_qwen35.plugin` (no torch import); the family in `ninfer_qwen35.family`;
tiny random artifacts for tests in `ninfer_qwen35.testing`.
"""
