"""Model plumbing, one topic per file; every public name also imports from `trl_ext.models`.

    forward.py       forward passes with real attention masks; log-probs of the response tokens
    generation.py    sampling from the policy as is (`TokenSampler`), `generate_responses`
    vllm_sampler.py  the colocated vLLM engine as a sampler, with the weight sync
    packing.py       padding-free forwards: a batch's real tokens as one sequence (`Packing`), and back; rows left
                     padded (`Padded`), the same calls
    value.py         the critic: value heads, the policy+value wrapper, the value model's initialisation, its frozen
                     trunk (`FrozenTrunk`)
    shared_base.py   one base for every role (`build_shared_base`, `SharedBaseModels`)
    preparation.py   dropout off, bitsandbytes' CPU repacking off, whether a model is quantized

Everything here takes explicit masks; nothing compares ids with the pad id.
"""

from .forward import (
    LOGPROB_CHUNK,
    accepts_logits_to_keep,
    lm_logits,
    model_input_ids,
    position_ids_from_mask,
    response_logprobs,
    sequence_inputs,
)
from .generation import Sampling, TokenSampler, eval_mode, generate_responses, generation_config_of, sampling_config
from .packing import Packing, Padded, check_padding_free, row_layout
from .preparation import (
    CHECKPOINTING_KWARGS,
    FP32Head,
    cast_lm_head_to_fp32,
    disable_bnb_cpu_repack,
    disable_dropout,
    is_quantized,
)
from .shared_base import CRITIC, POLICY, REWARD, SharedBaseModels, SharedRoleModel, build_shared_base
from .value import (
    FrozenTrunk,
    PolicyAndValueWrapper,
    build_value_model,
    freeze_backbone,
    lora_for_quantized_value_model,
    probe_batch,
    scalar_head_outputs,
)

__all__ = [
    "CHECKPOINTING_KWARGS", "CRITIC", "FP32Head", "FrozenTrunk", "LOGPROB_CHUNK", "POLICY", "Packing", "Padded",
    "PolicyAndValueWrapper", "REWARD", "Sampling", "SharedBaseModels", "SharedRoleModel", "TokenSampler",
    "accepts_logits_to_keep", "build_shared_base", "build_value_model", "cast_lm_head_to_fp32", "check_padding_free",
    "disable_bnb_cpu_repack", "disable_dropout", "eval_mode",
    "freeze_backbone", "generate_responses", "generation_config_of", "is_quantized", "lm_logits",
    "lora_for_quantized_value_model", "model_input_ids", "position_ids_from_mask", "probe_batch",
    "response_logprobs", "row_layout", "sampling_config", "scalar_head_outputs", "sequence_inputs",
]
