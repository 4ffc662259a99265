import os
import warnings

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each trainer builds an Accelerator; accelerate keeps process-wide state, so reset it between tests."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
