import os
import warnings
from importlib.metadata import version

import pytest
from packaging.version import Version

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one thread per worker (and its subprocesses), so two
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers share the cores instead of fighting over them
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each trainer builds an Accelerator; accelerate keeps process-wide state, so reset it between tests."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """accelerate's fp16 path as on a GPU (autocast to float16 and a GradScaler), on CPU: accelerate sets it up on
    GPUs only; torch's CPU autocast and GradScaler("cpu") run it the same way."""
    import torch
    from accelerate import Accelerator

    init = Accelerator.__init__

    def fp16_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.state.mixed_precision == "fp16" and self.device.type == "cpu":
            self.native_amp, self.scaler = True, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)

    monkeypatch.setattr(Accelerator, "__init__", fp16_init)


# Tests that compare against TRL's own PPOTrainer (marked `trl_ppo`) need a TRL that has one: trl 1.12. Under a newer
# TRL they are deselected, and said so in the report header; CI runs them in its trl 1.12 environment (.ci/run).
TRL_HAS_PPO = Version(version("trl")) < Version("1.13")


_DESELECTED = []


def pytest_collection_modifyitems(config, items):
    if TRL_HAS_PPO:
        return
    _DESELECTED[:] = [item.nodeid for item in items if item.get_closest_marker("trl_ppo")]
    if _DESELECTED:
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("trl_ppo")])
        items[:] = [item for item in items if not item.get_closest_marker("trl_ppo")]


def pytest_terminal_summary(terminalreporter):
    if _DESELECTED:
        terminalreporter.write_line(
            f"trl {version('trl')} has no PPOTrainer: {len(_DESELECTED)} tests marked trl_ppo (against TRL's own "
            f"trainer) were deselected; CI runs them with trl 1.12: {', '.join(_DESELECTED)}")
