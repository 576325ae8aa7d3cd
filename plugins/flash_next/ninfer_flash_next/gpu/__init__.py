"""The Flash-Next GPU path: ninfer_qwen35's GDN kernels and grouped-GEMM MoE behind this family's
layers, and the H200 bench (`python -m ninfer_flash_next.gpu.bench`)."""
