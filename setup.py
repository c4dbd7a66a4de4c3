from setuptools import find_packages, setup

setup(
    name="parallel3d",
    version="0.1.0",
    description="Megatron-style TP x PP x DP x CP x EP parallelism for transformer pretraining",
    python_requires=">=3.10",
    packages=find_packages(include=["parallel3d*"]),  # models/ and kernels/ install as parallel3d.models, parallel3d.kernels (links)
    install_requires=["torch>=2.5", "triton>=3.0", "numpy>=1.24", "einops>=0.7", "safetensors>=0.4",
                      "pyyaml>=6.0", "matplotlib>=3.7"],
    # `pytest` loads the multi-rank harness (fixture `multirank`) in any suite once parallel3d is installed;
    # the entry point's name is the module's, so an explicit `-p parallel3d.testing` does not register it twice
    entry_points={"pytest11": ["parallel3d.testing = parallel3d.testing"]},
    extras_require={
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "transformers>=4.45", "tokenizers>=0.19"],
        "gpu": ["flash-attn>=2.6"],
        "tensorboard": ["tensorboard>=2.14"],
    },
)
