from __future__ import annotations

import pytest
import torch

from voice_out.model.transfer import to_device


def test_cpu_lists_and_tensors() -> None:
    t = to_device([[1, 2], [3, 4]], torch.device("cpu"), torch.long)
    assert t.dtype == torch.long and t.tolist() == [[1, 2], [3, 4]]
    m = to_device([True, False], torch.device("cpu"), torch.bool)
    assert m.dtype == torch.bool and m.tolist() == [True, False]
    x = torch.arange(3, dtype=torch.int32)
    assert to_device(x, torch.device("cpu"), torch.long).dtype == torch.long
    assert to_device(x, torch.device("cpu")) is x  # nothing to do


@pytest.mark.requires_cuda
def test_cuda_copy_does_not_wait_for_queued_kernels() -> None:
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy for ~0.1 s
    t = to_device([5, 6, 7], dev, torch.int32)
    # a pageable copy would have returned only after the sleep kernel finished
    assert not torch.cuda.current_stream().query()
    assert t.device.type == "cuda" and t.dtype == torch.int32
    assert t.tolist() == [5, 6, 7]
    on_gpu = torch.ones(2, device=dev)
    assert to_device(on_gpu, dev) is on_gpu
