"""Data parallelism: gradient reduction (bucketed, overlapped), ZeRO-1/2/3, mixed precision."""
