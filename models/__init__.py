"""Reference models (Llama dense, MoE) built from parallel3d layers."""
