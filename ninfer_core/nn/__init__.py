"""Core's library of hybrid-model layers (Gated DeltaNet, gated attention, norms, rotary, sparse MoE,
MTP head, the decoder layer, the forward context, weight loading), each a torch reference path that
the CPU runs and tests use. Model-family plugins build on it instead of on each other; it names no
family. See docs/plugins/model-families.md ("Core's hybrid-model library")."""
