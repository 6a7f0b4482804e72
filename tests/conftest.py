import pytest
import torch


@pytest.fixture(autouse=True)
def _fixed_threads():
    """Tests compare floating-point results: keep the thread count fixed."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
