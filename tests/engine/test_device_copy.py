"""engine/device_copy.py: a step's small host inputs reach the device without the host waiting for queued work."""
import pytest

torch = pytest.importorskip("torch")

from engine.device_copy import list_to_device, to_device  # noqa: E402


def test_on_cpu_the_values_come_back_as_given():
    cpu = torch.device("cpu")
    assert list_to_device([3, -1, 7], torch.int64, cpu).tolist() == [3, -1, 7]
    assert list_to_device([0.25, 1.5], torch.float64, cpu).dtype == torch.float64
    host = torch.arange(5)
    assert to_device(host, cpu) is host


@pytest.mark.gpu
def test_gpu_copies_do_not_wait_for_the_queued_kernels_and_arrive_intact():
    device = torch.device("cuda")
    torch.cuda.synchronize()
    for _ in range(3):
        torch.cuda._sleep(2_000_000_000)     # about a second of queued work
        queued = torch.cuda.Event()
        queued.record()
        copies = [list_to_device(list(range(i, i + 300)), torch.int64, device) for i in range(20)]
        copies.append(to_device(torch.full((4, 64), 7, dtype=torch.int32), device))
        assert not queued.query(), "a copy waited for the kernels queued before it"
        torch.cuda.synchronize()
        assert all(c.tolist() == list(range(i, i + 300)) for i, c in enumerate(copies[:-1]))
        assert bool((copies[-1] == 7).all())
