"""What the colocated vLLM engine is built with (trl_ext/models/vllm_sampler.py), against a stand-in `vllm.LLM` that
records its arguments: vLLM itself runs in tests_vllm/ (one process)."""

import sys
import types

import pytest
import torch

from trl_ext.models import Sampling
from trl_ext.models.vllm_sampler import VLLMSampler
from trl_ext.testing import tiny_causal_lm, tiny_tokenizer


@pytest.fixture
def recorded(monkeypatch):
    """A `vllm` module whose LLM records the keyword arguments it is built with."""
    calls = []

    class LLM:
        def __init__(self, **kwargs):
            calls.append(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    return calls


def build(**kw):
    tok = tiny_tokenizer()
    return VLLMSampler(tiny_causal_lm(tok), tok, Sampling(6, 1.0, None), dtype=torch.float32, seed=0,
                       max_model_len=64, **kw)


def test_each_process_of_a_ddp_run_runs_its_engine_in_process(recorded):
    # vLLM's default executor starts its worker on device 0 of every process: under DDP all engines on one GPU
    build(distributed=True)
    assert recorded[-1]["distributed_executor_backend"] == "external_launcher"
    build()
    assert "distributed_executor_backend" not in recorded[-1]  # one process: vLLM's default


def test_tensor_parallel_engines_get_whole_weights_as_files(recorded):
    assert build(tensor_parallel_size=2).weights_by_file and not build().weights_by_file


def test_tensor_parallel_across_trainer_processes_is_refused(recorded):
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2 with several trainer processes.*=1"):
        build(tensor_parallel_size=2, distributed=True)
