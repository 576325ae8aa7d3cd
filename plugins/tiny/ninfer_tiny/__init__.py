"""ninfer-tiny: the project's own small Qwen3.5-architecture model.

Modules: `data` (synthetic conversations + prose, deterministic from a seed), `prose` (English
prose from the markov-draftjs package), `bpe` (training the byte-level BPE and exporting a NInfer
tokenizer section), `model` (the training module: transformers' Qwen3_5ForCausalLM plus the MTP
head under the checkpoint's names), `train` (the training command), `evaluate` (the evaluation
table through a live server), `plugin` (the default-artifact hook).
"""
