"""Writes tests/golden/safetensors/python_written.safetensors with the reference implementation
(huggingface safetensors), so the C++ reader is checked against a file it did not write.

Run: python3 tools/ref/make_safetensors_golden.py
"""
import torch

import golden

tensors = {
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3) - 1.5,
    "b": torch.tensor([1, -2, 3, -4], dtype=torch.int64),
    "c": torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16),
    "d": torch.tensor(0.5, dtype=torch.float64),
}
golden.save("safetensors/python_written.safetensors", tensors, seed=0, writer="huggingface-safetensors")
