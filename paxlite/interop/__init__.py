"""Checkpoint conversion: Hugging Face (LLaMA, Mixtral, GPT-2) <-> paxlite, Meta LLaMA -> paxlite.

Submodules import torch / transformers / safetensors lazily, only on the path that reads or writes
such files; ``from paxlite.interop import hf`` is the public entry point (docs/interop.md,
"Python API").
"""
