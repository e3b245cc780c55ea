from setuptools import find_packages, setup

setup(
    name="acl-fairseq",
    version="0.1.0",
    description=(
        "Aligned Contrastive Learning (ACL-Embed, ACL-Grad, ACL-CL) and multi-exit "
        "early-exit RoBERTa/BERT fine-tuning as a fairseq plugin"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=find_packages(include=["acl_fairseq", "acl_fairseq.*"]),
    python_requires=">=3.10",
    # fairseq itself is installed separately (fairseq-fixed, built with
    # --no-build-isolation --no-deps, see the README): listing it here would make pip
    # pull torchaudio and a second torch.
    # safetensors: acl-fairseq-convert-bert reads Hugging Face weights (the demo's MiniLM)
    install_requires=["torch>=2.5", "numpy>=2", "sentencepiece", "tokenizers", "safetensors"],
    extras_require={
        # onnxruntime, onnx, onnxscript: the ONNX Runtime backend's tests
        # (acl_fairseq.runtime.onnx_runtime; none of them pulls a torch)
        "test": [
            "pytest",
            "pytest-xdist",
            "ruff",
            "transformers",
            "safetensors",
            "matplotlib",
            "onnxruntime",
            "onnx",
            "onnxscript",
        ],
        # the ONNX Runtime backend (acl-fairseq-predict --backend onnxruntime) and
        # benchmarks/inference_anchors.py's ONNX Runtime rows
        "bench": ["transformers", "onnxruntime", "onnx", "onnxscript"],
    },
    entry_points={
        "console_scripts": [
            "acl-fairseq-prepare = acl_fairseq.cli.prepare:main",
            "acl-fairseq-convert-bert = acl_fairseq.cli.convert_bert:main",
            "acl-fairseq-export-hf = acl_fairseq.cli.export_hf:main",
            "acl-fairseq-bundle = acl_fairseq.cli.bundle:main",
            "acl-fairseq-compare = acl_fairseq.cli.compare:main",
            "acl-fairseq-sweep = acl_fairseq.cli.sweep:main",
            "acl-fairseq-predict = acl_fairseq.cli.predict:main",
            "acl-fairseq-plots = acl_fairseq.cli.plots:main",
            "acl-fairseq-demo = acl_fairseq.cli.demo:main",
            "acl-fairseq-fewshot = acl_fairseq.cli.fewshot:main",
        ]
    },
)
