"""DeepSeek FP8 checkpoints dequantized independently of jaxinfer's fp8 module (numpy, from the raw e4m3 bytes):
the oracle of the FP8 checkpoint tests (checkpoint/test_fp8_checkpoint.py, models/test_mtp.py,
test_default_model.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch


def fp8_bits_to_f32(q: torch.Tensor) -> np.ndarray:
    """e4m3 tensor -> float32 by decoding its raw bytes with ml_dtypes (exact: e4m3 values are f32 values)."""
    return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def dequantize_exact(q: torch.Tensor, scale_inv: np.ndarray, block: int = 128) -> np.ndarray:
    """w[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128] (the last, partial block is the zero-padded one)."""
    w = fp8_bits_to_f32(q)
    rows, cols = w.shape
    assert scale_inv.shape == (-(-rows // block), -(-cols // block)), (w.shape, scale_inv.shape)
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, 0), block, 1)[:rows, :cols]
    return w * s


def dequantize_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every tensor of an FP8 checkpoint as the float32 values it means (scales consumed)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_exact(t, tensors[name + "_scale_inv"].numpy())
        else:
            out[name] = t.float().numpy()
    return out
