"""Test-only patches that let accelerate 1.15 run DeepSpeed and FSDP2 on 2 CPU processes (gloo). Import first.

accelerate 1.15 treats these engines as GPU-only on CPU, although both run there:
- DeepSpeed: `PartialState._prepare_backend` finds no backend when the launch is not `--cpu` and no GPU exists, so
  accelerate counts 1 process while DeepSpeed (`DS_ACCELERATOR=cpu`) has 2 gloo ranks. The patch answers gloo /
  MULTI_CPU there (what `--cpu` would give), and DeepSpeed's plugin keeps the run a DeepSpeed run.
- FSDP: `AcceleratorState` turns an FSDP config into MULTI_CPU (DDP) on CPU: the patch keeps the FSDP plugin and
  the FSDP distributed type, and FSDP2's `fully_shard` then shards over a gloo CPU mesh.
And one that saves time: DeepSpeed on CPU compiles its shared-memory all-reduce op (`deepspeed.comm.torch.build_shm_op`,
again for every new virtual environment) although only its `inference_all_reduce`
(tensor-parallel inference) uses it; ZeRO's training collectives are torch.distributed's, over gloo here. Under a
DeepSpeed launch the op is not built.
Nothing in trl_ext depends on these patches; on GPUs accelerate needs none of them.
"""

import os

import accelerate.state as state
from accelerate.utils import DistributedType

_prepare_backend = state.PartialState._prepare_backend


def _prepare_backend_cpu(self, cpu=False, sagemaker_dp=False, backend=None):
    found, kind = _prepare_backend(self, cpu, sagemaker_dp, backend)
    if found is None and kind == DistributedType.NO and state.get_int_from_env(["WORLD_SIZE"], 1) > 1:
        return "gloo", DistributedType.MULTI_CPU
    return found, kind


_accelerator_state_init = state.AcceleratorState.__init__


def _accelerator_state_init_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    plugin = fsdp_plugin or self.__dict__.get("fsdp_plugin")
    if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = plugin
        # later AcceleratorState() calls copy PartialState's shared fields over this one's
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


state.PartialState._prepare_backend = _prepare_backend_cpu
state.AcceleratorState.__init__ = _accelerator_state_init_fsdp

if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
    import importlib

    # (by its module name: the attribute deepspeed.comm.torch is the torch package, which deepspeed.comm imports)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # inference_all_reduce: torch's
