"""The Flash-Next GPU path: core's GDN kernels and grouped-GEMM MoE (`ninfer_core.accel`) behind this family's
layers, and the H200 bench (`python -m ninfer_flash_next.gpu.bench`)."""
