import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes: intra-op threads only contend on the shared CPU (30x slower measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
