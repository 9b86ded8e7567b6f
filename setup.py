"""Packaging for tb_nanwatch.

The recorder needs TensorFlow; the TensorBoard plugin and the CLI do not.
TensorFlow is therefore an extra, so that users of ``tensorflow``,
``tensorflow-cpu`` or a vendor build install no second copy:

    pip install tb_nanwatch[tensorflow-cpu]   # or [tensorflow], or plain tb_nanwatch
"""

from setuptools import find_packages, setup

setup(
    name="tb_nanwatch",
    version="0.1.0",
    description="Find where NaN/Inf is born in Keras training, shown as a TensorBoard tab",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tb_nanwatch", "tb_nanwatch.*"]),
    package_data={"tb_nanwatch.board": ["static/*"]},
    include_package_data=True,
    install_requires=[
        "tensorboard>=2.16,<2.22",
        "protobuf>=3.20",
        "werkzeug>=2.0",
        "numpy>=1.23",
    ],
    extras_require={
        "tensorflow": ["tensorflow>=2.16,<2.22"],
        "tensorflow-cpu": ["tensorflow-cpu>=2.16,<2.22"],
        # tf_keras (Keras 2) models, for TF_USE_LEGACY_KERAS=1 code bases.
        "tf-keras": ["tf-keras>=2.16,<2.22"],
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "hypothesis>=6",
            "playwright>=1.40",
            "ruff>=0.5",
        ],
    },
    entry_points={
        "console_scripts": ["tb-nanwatch=tb_nanwatch.cli:main"],
        "tensorboard_plugins": ["nanwatch=tb_nanwatch.board.plugin:NanWatchPlugin"],
    },
)
