import pytest
import torch


@pytest.fixture(autouse=True)
def _fixed_threads():
    """Tests compare floating-point results: keep the thread count fixed."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at(k)``: the simulator raises KeyboardInterrupt (as Ctrl-C would) when about to take step k,
    ``k`` a step number or a function of the simulator; ``interrupt_at(k, error)`` raises ``error`` instead;
    ``monkeypatch.undo()`` lets runs go on again."""
    from cdsgd.simulator import Simulator

    real = Simulator.step

    def arm(k, error: BaseException | type = KeyboardInterrupt) -> None:
        def step_then_stop(self):
            if self.k == (k(self) if callable(k) else k):
                raise error
            return real(self)

        monkeypatch.setattr(Simulator, "step", step_then_stop)

    return arm
