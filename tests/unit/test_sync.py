"""The start-up transfer's buckets (``startup/sync.py``): mixed dtypes at aligned offsets, a lone
tensor in place. The transfer on ranks: ``distributed/test_sync.py``."""

from __future__ import annotations

import torch

from rannc_fx.startup import sync


def test_a_bucket_holds_mixed_dtypes_at_aligned_offsets_and_a_lone_tensor_travels_in_place():
    tensors = [torch.tensor([True, False, True]), torch.randn(3, dtype=torch.float64),
               torch.arange(5), torch.randn(4, 6).t(), torch.randn(3).to(torch.bfloat16),
               torch.randn(())]  # fmt: skip
    buf, offsets = sync._wire(tensors, torch.device("cpu"))
    assert offsets is not None and buf.dtype == torch.uint8
    for t, o in zip(tensors, offsets, strict=True):
        assert o % t.element_size() == 0
        sync._slot(buf, o, t).copy_(t)  # the sender packs
    for t, o in zip(tensors, offsets, strict=True):
        got = torch.zeros_like(t)
        got.copy_(sync._slot(buf, o, t))  # a receiver unpacks
        assert torch.equal(got, t)
    lone = torch.randn(4, 4)
    buf, offsets = sync._wire([lone], torch.device("cpu"))
    assert offsets is None and buf.data_ptr() == lone.data_ptr() and buf.numel() == 64
    buf, offsets = sync._wire([lone.t()], torch.device("cpu"))  # not contiguous: packed
    assert offsets == [0] and buf.data_ptr() != lone.data_ptr()
