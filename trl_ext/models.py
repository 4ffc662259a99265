"""Model plumbing: forward passes with real attention masks, generation that samples from the policy as is, the
policy+value wrapper the optimizer trains, and the shared-base models (one base, every PPO role an adapter).
Everything here takes explicit masks; nothing compares ids with the pad id.

Shapes: B = batch, Q = query (prompt) length, T = response length, V = vocabulary, H = hidden size.

Memory: causal LMs are asked for the logits of the last T + 1 positions only (`logits_to_keep`, where the model takes
it), and log-probs come from `trl_ext.core.token_logprobs` (chunks of positions; no (B, T, V) fp32 tensor).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
from contextlib import contextmanager

import torch
import torch.nn as nn
from transformers import GenerationConfig

from .core import token_logprobs

LOGPROB_CHUNK = 64  # positions per chunk in log-prob / entropy computations: one (64, V) fp32 tensor at a time
POLICY, CRITIC, REWARD = "policy", "critic", "reward"  # adapter names of a shared base


# ---------------------------------------------------------------------------------------------------- bitsandbytes

def disable_bnb_cpu_repack(*models) -> int:
    """Set `support_avx512bf16_for_cpu = False` on every bitsandbytes `Linear4bit` of the given models; returns how
    many layers were found.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a 4-bit weight in place the first time it sees a no-grad
    forward in eval mode, and the repacked path (gemv_4bit) has no autograd: LoRA gradients through that layer come
    out silently wrong afterwards. With the flag off the weights are never repacked. A layer that was already
    repacked is an error (bitsandbytes' inverse conversion is lossy): call this right after loading the model.
    """
    count = 0
    for model in models:
        if not isinstance(model, nn.Module):
            continue
        for name, module in model.named_modules():
            if not hasattr(module, "support_avx512bf16_for_cpu"):
                continue
            module.support_avx512bf16_for_cpu = False
            count += 1
            state = getattr(getattr(module, "weight", None), "quant_state", None)
            if getattr(state, "packing_format_for_cpu", False):
                raise ValueError(
                    f"The 4-bit layer {name!r} of {type(model).__name__} was already repacked for AVX512-BF16 CPU "
                    "inference (a no-grad forward in eval mode ran on it); LoRA gradients through it would be wrong. "
                    "Call trl_ext.models.disable_bnb_cpu_repack(model) right after loading, before any evaluation "
                    "forward, or reload the model.")
    return count


# ---------------------------------------------------------------------------------------------------- dropout

def _is_rate(name: str, value) -> bool:
    return "drop" in name.lower() and isinstance(value, float) and value > 0


def disable_dropout(model: nn.Module) -> None:
    """Turn off every dropout of `model`, whatever form it takes, so rollout and update forwards are deterministic:

    - `nn.Dropout` modules (p = 0; all TRL's `disable_dropout_in_model` does);
    - rates stored on modules and applied in forward in training mode (Llama's and Qwen's `attention_dropout`, OPT's
      `dropout`, Bloom's `hidden_dropout`: `dropout(x, p=self.dropout, training=self.training)`);
    - rates in the model's config read at forward time (`self.config.layerdrop`, ...).

    PPO needs this: with dropout on, the rollout's log-probs and the update's differ at lr 0 (ratio ≠ 1, KL ≠ 0
    against an identical reference). The config's rates stay 0 in a saved model's config.json."""
    from transformers import PretrainedConfig

    configs = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_rate(name, value):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig) and all(config is not c for c in configs):
            configs.append(config)
    while configs:
        config = configs.pop()
        for name, value in list(vars(config).items()):
            if _is_rate(name, value):
                setattr(config, name, 0.0)
            elif isinstance(value, PretrainedConfig):  # text_config, vision_config, ...
                configs.append(value)


# ---------------------------------------------------------------------------------------------------- forwards

def _underlying(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the causal LM computes logits for the last k positions only when given `logits_to_keep=k`."""
    return _forward_accepts_logits_to_keep(type(_underlying(model)))


@functools.cache
def _forward_accepts_logits_to_keep(model_class: type) -> bool:  # inspect.signature costs ~1.5 ms: once per class
    try:
        return "logits_to_keep" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


def lm_logits(model: nn.Module, inputs: dict, logits_to_keep: int = 0) -> torch.Tensor:
    """(B, L', V) logits: the last `logits_to_keep` positions where the model supports it (0: all L positions)."""
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep and accepts_logits_to_keep(model) else {}
    return model(**inputs, use_cache=False, **kwargs).logits


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool/long -> (B, L) long: 0 at the first real token, counting real tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def model_input_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Token ids a model may read: masked-out positions (padding, anything after the stop token) hold id 0, so a pad id
    outside the embedding table (a `[PAD]` added to the tokenizer but not to the model, as TRL's scripts do) never
    reaches the model. TRL does the same (`masked_fill(~attention_mask, 0)` before every forward)."""
    return input_ids.masked_fill(~attention_mask.bool(), 0)


def sequence_inputs(queries, query_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """Model inputs for query+response: (B, Q+T) ids, attention mask and position ids. Tokens after the stop token
    (response_mask False) are masked out, so nothing reads them; masked positions hold id 0 (`model_input_ids`)."""
    attention_mask = torch.cat([query_mask, response_mask], dim=1).long()
    input_ids = model_input_ids(torch.cat([queries, responses], dim=1), attention_mask)  # (B, Q+T)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask)}


def response_logprobs(model: nn.Module, inputs: dict, responses: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T) fp32 log π(response token) under softmax(logits / temperature), without a (B, T, V) fp32 tensor.
    `inputs` from `sequence_inputs`; the tokens are its last T ids (positions after the stop token hold id 0 there,
    where `responses` may hold a pad id the model does not have)."""
    T = responses.shape[1]
    logits = lm_logits(model, inputs, T + 1)  # (B, T+1, V) or (B, Q+T, V)
    return token_logprobs(logits[:, -T - 1 : -1], inputs["input_ids"][:, -T:], temperature, LOGPROB_CHUNK)


# ---------------------------------------------------------------------------------------------------- sampling

@dataclasses.dataclass(frozen=True)
class Sampling:
    """What PPO samples: `response_length` tokens from softmax(logits / temperature), stopping at `stop_token_id`
    (None: no stop token; EOS is then an ordinary token and every response has `response_length` tokens)."""

    response_length: int
    temperature: float
    stop_token_id: int | None


def sampling_config(sampling: Sampling) -> GenerationConfig:
    """The complete GenerationConfig `generate_responses` runs `generate()` with: greedy decoding over the one-hot
    scores of `TokenSampler` (which draws the token itself), every other logits processor off, KV cache on.

    Every field is set: transformers' defaults for everything else, and nothing is ever filled in from a model's own
    `generation_config` (`generate_responses` swaps it for this one during the call). Finished rows are filled with
    the stop token (an id the model has), never with the tokenizer's pad id."""
    config = GenerationConfig(**GenerationConfig()._get_default_generation_params())
    config.update(
        max_new_tokens=sampling.response_length, max_length=None, min_length=0,
        do_sample=False, num_beams=1, num_return_sequences=1, use_cache=True,
        eos_token_id=sampling.stop_token_id,
        pad_token_id=0 if sampling.stop_token_id is None else sampling.stop_token_id,
        output_scores=False, output_logits=False, return_dict_in_generate=False,
    )
    return config


class TokenSampler:
    """A logits processor that *is* the sampler: it draws each next token from softmax(scores / temperature) with
    torch's RNG, records that token's log-prob (fp32), and returns scores that are 0 at the drawn token and −inf
    elsewhere, so greedy decoding in `generate()` takes exactly that token. No warper of transformers (top-k, top-p,
    min-p, temperature, ...) can then change what is sampled: whatever a model's generation_config says, the tokens
    PPO trains on come from the policy's own distribution, and `logprobs` are the sampler's log-probs of them."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []  # one (B,) fp32 tensor per generation step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        tokens = torch.multinomial(logp.exp(), num_samples=1)  # (B, 1)
        self.steps.append(logp.gather(1, tokens).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


@contextmanager
def eval_mode(model: nn.Module):
    """Every submodule in eval mode inside, each restored to its own mode after. Generation runs so: no dropout, and
    gradient checkpointing (active only in training mode) never turns off the KV cache (transformers 5.3-5.23 drop
    the cache of a checkpointed model in training mode even without grad)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextmanager
def generation_config_of(model: nn.Module, config: GenerationConfig):
    """`model.generation_config` (the transformers model under a peft wrapper) is `config` inside: `generate()` fills
    every field left None from the model's own config (min_p, suppress_tokens, eos_token_id, ...), so the model's
    config must hold nothing but ours while PPO samples."""
    target = _underlying(model)
    saved = getattr(target, "generation_config", None)
    target.generation_config = config
    try:
        yield
    finally:
        target.generation_config = saved


@torch.no_grad()
def generate_responses(policy, queries, query_mask, sampling: Sampling,
                       chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses for left-padded queries, in chunks of `chunk_size` rows.

    Returns (B, T) ids, T = `sampling.response_length` (positions after the stop token hold the stop token, or are
    unfilled past the end of generation: the response mask from the stop position hides them), and the sampler's
    (B, T) fp32 log-probs of those tokens (`TokenSampler`; meaningless after the stop token). Runs with the policy in
    eval mode, the KV cache on, and the model's own generation_config out of the way; the caller sets the precision
    (the trainer generates under the same autocast as the loss)."""
    from transformers import LogitsProcessorList

    config = sampling_config(sampling)
    B, T = queries.shape[0], sampling.response_length
    fill = config.pad_token_id
    responses = torch.full((B, T), fill, dtype=queries.dtype, device=queries.device)
    logprobs = torch.zeros((B, T), dtype=torch.float32, device=queries.device)
    with eval_mode(policy), generation_config_of(policy, config):
        for i in range(0, B, chunk_size):
            q, m = queries[i : i + chunk_size], query_mask[i : i + chunk_size].long()
            sampler = TokenSampler(sampling.temperature)
            seq = policy.generate(input_ids=model_input_ids(q, m), attention_mask=m, generation_config=config,
                                  logits_processor=LogitsProcessorList([sampler]))
            n = seq.shape[1] - q.shape[1]  # tokens generated (the sampler may have run steps generate undid)
            responses[i : i + q.shape[0], :n] = seq[:, q.shape[1]:]
            if n:
                logprobs[i : i + q.shape[0], :n] = torch.stack(sampler.steps[:n], dim=1).to(logprobs.device)
    return responses, logprobs


def scalar_head_outputs(model: nn.Module, inputs: dict, trunk: FrozenTrunk | None = None,
                        trunk_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L) per-position scalar of a sequence-classification model (TRL's reward/value model layout: a backbone
    under `base_model_prefix` and a `score` head; a peft-wrapped one is read through its active adapter).
    With a `FrozenTrunk` and its (B, L, H) output `trunk_hidden`, only the layers above the trunk run."""
    if trunk is not None and trunk_hidden is not None:
        hidden = trunk.top(inputs, trunk_hidden)
    else:
        hidden = _backbone(model)(**inputs, use_cache=False).last_hidden_state
    score = _underlying(model).score
    weight = getattr(score, "weight", None)
    if weight is not None and weight.dtype != hidden.dtype and weight.dtype.is_floating_point:
        hidden = hidden.to(weight.dtype)  # a head kept in fp32 over a bf16 / 4-bit backbone
    return score(hidden).squeeze(-1)  # (B, L)


def _backbone(model: nn.Module) -> nn.Module | None:
    """The decoder under `base_model_prefix` of a transformers model (read through a peft wrapper)."""
    model = _underlying(model)
    return getattr(model, getattr(model, "base_model_prefix", ""), None)


def probe_batch(vocab_size: int, device) -> tuple[dict, torch.Tensor]:
    """A check's input: 2 rows of a 4-token prompt (one left-padded) and 2 response tokens, as `sequence_inputs`
    builds them, and the (2, 2) responses."""
    ids = torch.arange(12, device=device).reshape(2, 6) % vocab_size
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :2] = False
    return sequence_inputs(ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:]), ids[:, 4:]


class FrozenTrunk:
    """The frozen lower part of a Llama-style value model (`freeze_backbone`): its embeddings and first `layers`
    decoder layers train nothing, so their output for a rollout is the same at every minibatch of the iteration. The
    rollout keeps it (`hidden_states`) and the update runs the trainable top alone from it
    (`scalar_head_outputs(..., trunk, trunk_hidden)`): the critic's forward in the update costs its top layers."""

    def __init__(self, value_model: nn.Module, layers: int):
        self.backbone = _backbone(value_model)
        self.layers = layers

    @staticmethod
    def of(value_model: nn.Module) -> FrozenTrunk | None:
        """The frozen trunk of `value_model` if it has one (a Llama-style backbone whose embeddings and first k >= 1
        layers are all frozen, k < all layers) and the split forward gives its full forward's values; else None."""
        backbone = _backbone(value_model)
        layers = getattr(backbone, "layers", None)
        embed = getattr(backbone, "embed_tokens", None)
        if not isinstance(layers, nn.ModuleList) or embed is None or not hasattr(_underlying(value_model), "score") \
                or any(p.requires_grad for p in embed.parameters()):
            return None
        k = 0
        while k < len(layers) and not any(p.requires_grad for p in layers[k].parameters()):
            k += 1
        if k == 0 or k == len(layers):
            return None
        trunk = FrozenTrunk(value_model, k)
        return trunk if trunk._split_matches(value_model) else None

    @torch.no_grad()
    def _split_matches(self, value_model: nn.Module) -> bool:
        """One forward of 2 x 6 tokens both ways: a backbone that does more than embed -> layers -> norm (an
        embedding scale, layers that read their index) keeps the full forward."""
        inputs, _ = probe_batch(_underlying(value_model).config.vocab_size, next(self.backbone.parameters()).device)
        try:
            full = scalar_head_outputs(value_model, inputs)
            split = scalar_head_outputs(value_model, inputs, self, self.hidden_states(inputs))
        except Exception:  # noqa: BLE001 - a backbone this does not fit: the full forward it is
            return False
        return full.shape == split.shape and torch.allclose(full.float(), split.float(), atol=1e-5, rtol=1e-4)

    def same_weights_as(self, reference: nn.Module) -> bool:
        """Whether `reference` (a causal LM, or a peft policy read with its adapters off) holds this trunk's exact
        embeddings and lower layers: the critic built from the policy's own checkpoint. The reference pass then
        computes the trunk's output on the way (`capture`), and the critic's frozen layers need not run at all."""
        backbone = _backbone(reference)
        layers = getattr(backbone, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) < self.layers:
            return False
        pairs = [(self.backbone.embed_tokens, getattr(backbone, "embed_tokens", None))]
        pairs += [(self.backbone.layers[i], layers[i]) for i in range(self.layers)]
        for ours, theirs in pairs:
            if theirs is None:
                return False
            # peft keeps a wrapped layer's own weight as `<name>.base_layer.weight`, beside its adapters' `lora_*`
            their_params = {name.replace(".base_layer", ""): p for name, p in theirs.named_parameters()
                            if "lora_" not in name}
            our_params = dict(ours.named_parameters())
            if their_params.keys() != our_params.keys() or not all(
                    p.shape == their_params[n].shape and p.dtype == their_params[n].dtype
                    and torch.equal(p, their_params[n].to(p.device)) for n, p in our_params.items()):
                return False
        return True

    def reference_layer(self, reference: nn.Module) -> nn.Module:
        """The reference's layer whose output is this trunk's output (after `same_weights_as`)."""
        return _backbone(reference).layers[self.layers - 1]

    @contextmanager
    def capture(self, layer: nn.Module):
        """Inside: every output of `layer` (the reference's layer at the trunk's top) is appended to the list."""
        captured: list[torch.Tensor] = []
        handle = layer.register_forward_hook(lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o))
        try:
            yield captured
        finally:
            handle.remove()

    @contextmanager
    def _only(self, layers: slice):
        """The backbone with only `layers` of its decoder layers inside."""
        full = self.backbone.layers
        self.backbone.layers = full[layers]
        try:
            yield
        finally:
            self.backbone.layers = full

    def hidden_states(self, inputs: dict) -> torch.Tensor:
        """(B, L, H) the frozen layers' output: the input of the first trainable layer."""
        with self.capture(self.backbone.layers[self.layers - 1]) as captured, self._only(slice(None, self.layers)):
            self.backbone(**inputs, use_cache=False)
        return captured[0]

    def top(self, inputs: dict, hidden: torch.Tensor) -> torch.Tensor:
        """(B, L, H) last hidden state of the backbone run from its first trainable layer on, over `hidden`."""
        with self._only(slice(self.layers, None)):
            return self.backbone(inputs_embeds=hidden, attention_mask=inputs["attention_mask"],
                                 position_ids=inputs["position_ids"], use_cache=False).last_hidden_state


class PolicyAndValueWrapper(nn.Module):
    """Policy and value model as one module, so one `accelerate.prepare` (DDP/DeepSpeed/FSDP) wraps both.
    Keeps TRL's attribute names (`policy`, `value_model`) so TRL's own helpers work on it."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.gradient_checkpointing_kwargs: dict | None = None
        self.value_trunk: FrozenTrunk | None = None  # set by the trainer where the engine allows (PPOTrainer)

    @property
    def _no_split_modules(self) -> list[str]:
        """The policy's and the value model's layer classes: FSDP's TRANSFORMER_BASED_WRAP shards each such layer on
        its own (accelerate reads this when the config names no class)."""
        names = []
        for module in (self.policy, self.value_model):
            names += [n for n in getattr(_underlying(module), "_no_split_modules", None) or [] if n not in names]
        return names

    def policy_parameters(self) -> list[nn.Parameter]:
        return list(self.policy.parameters())

    def value_parameters(self) -> list[nn.Parameter]:
        return list(self.value_model.parameters())

    # TRL's `unwrap_model_for_generation` turns checkpointing off while generating (it breaks the KV cache) and back
    # on with no arguments afterwards: the kwargs given first (use_reentrant=False) are remembered for that.
    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.policy, "is_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs):
        if gradient_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        for module in (self.policy, self.value_model):
            if getattr(module, "supports_gradient_checkpointing", False):
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=self.gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        for module in (self.policy, self.value_model):
            if getattr(module, "supports_gradient_checkpointing", False):
                module.gradient_checkpointing_disable()

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int = 0, role: str = "both",
                trunk_hidden: torch.Tensor | None = None):
        """-> (policy logits (B, L', V), values (B, L)); L' = `logits_to_keep` where the policy supports it.
        role="value": the values alone (a rollout whose π_old is the sampler's, `PPOConfig.rollout_logprobs`);
        role="policy": the logits alone (critic warmup's gradient-free policy pass).
        trunk_hidden: the output of the critic's frozen trunk (`value_trunk`, kept by the rollout): only the
        critic's layers above it run."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if role not in ("both", "value", "policy"):
            raise ValueError(f"role={role!r} is not one of 'both', 'value', 'policy'.")
        if role == "policy":
            return lm_logits(self.policy, inputs, logits_to_keep)
        values = scalar_head_outputs(self.value_model, inputs, self.value_trunk, trunk_hidden)
        return values if role == "value" else (lm_logits(self.policy, inputs, logits_to_keep), values)


# ---------------------------------------------------------------------------------------------------- shared base

class _AdapterBackbone:
    """Callable in TRL's backbone slot (`model.<base_model_prefix>(**inputs).last_hidden_state`): the shared base's
    decoder run with one adapter active. Not an nn.Module, so the views below own no base weights."""

    def __init__(self, shared: SharedBaseModels, adapter: str):
        self.shared, self.adapter = shared, adapter

    def __call__(self, **inputs):
        with self.shared.adapter(self.adapter):
            return self.shared.decoder(**inputs)


class SharedRoleModel(nn.Module):
    """A value or reward model that is one adapter of a shared base plus its own scalar head (`score`), in TRL's
    layout (`base_model_prefix`, backbone, `score`), so `scalar_head_outputs` and `RewardScorer` read it like any
    sequence-classification model. It owns only its head; the base lives in the `SharedBaseModels`."""

    base_model_prefix = "backbone"

    def __init__(self, shared: SharedBaseModels, adapter: str, head: nn.Linear):
        super().__init__()
        self.score = head
        self.adapter_name = adapter
        self.__dict__["backbone"] = _AdapterBackbone(shared, adapter)  # a plain attribute, not a submodule
        self.__dict__["shared"] = shared
        self.config = copy.copy(shared.policy.config)
        self.config._name_or_path = f"{adapter}_adapter"

    def adapter_parameters(self) -> list[nn.Parameter]:
        return self.shared.adapter_parameters(self.adapter_name)


class SharedBaseModels(nn.Module):
    """One base model (4-bit, 8-bit or bf16) serving every PPO role; build it with `build_shared_base`.

    - policy: the base with LoRA adapter "policy" (trained);
    - reference: the base with adapters disabled;
    - critic (`value_model`): the base with LoRA adapter "critic" (trained) and a scalar `value_head` (trained);
    - reward (`reward_model`, optional): the base with a frozen adapter "reward" and its frozen score head.

    Pass it as `PPOTrainer(model=shared, ref_model=None, value_model=None, reward_model=shared.reward_model or any
    other reward)`. Only the policy and critic adapters and the value head are trainable; the trainer's optimizer
    holds exactly those. The active adapter at rest is "policy" (generation and the policy forward use it); every
    other role switches with `adapter(name)` / `reference()` and switches back on exit.

    Gradient checkpointing recomputes a layer's forward during backward with whatever adapter is active *then*, so
    a role's backward must run inside its own `adapter(...)` context (`PPOTrainer.ppo_update` does: one backward per
    role).
    """

    def __init__(self, policy, value_head: nn.Linear, reward_head: nn.Linear | None = None):
        super().__init__()
        self.policy = policy  # the PeftModel: adapters "policy", "critic" (and "reward")
        self.value_model = SharedRoleModel(self, CRITIC, value_head)
        self._reward_model = SharedRoleModel(self, REWARD, reward_head) if reward_head is not None else None
        if self._reward_model is not None:
            self._reward_model.requires_grad_(False)
        self.gradient_checkpointing_kwargs: dict | None = None
        self._restore_trainable()

    # -- roles
    @property
    def decoder(self) -> nn.Module:
        """The base's transformer body (hidden states), with the LoRA layers inside it."""
        base = self.policy.get_base_model()
        return getattr(base, base.base_model_prefix)

    @property
    def reward_model(self) -> SharedRoleModel:
        if self._reward_model is None:
            raise ValueError("This shared base has no reward adapter: pass reward_adapter=... to build_shared_base, "
                             "or give the trainer another reward_model (a model or a function).")
        return self._reward_model

    @property
    def has_reward(self) -> bool:
        return self._reward_model is not None

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """The LoRA parameters of adapter `name` (in module order)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        if name not in self.policy.peft_config:
            raise ValueError(f"no adapter {name!r}; the adapters are {list(self.policy.peft_config)}.")
        params = []
        for module in self.policy.modules():
            if isinstance(module, BaseTunerLayer):
                for layer_name in module.adapter_layer_names:
                    layers = getattr(module, layer_name)
                    if name in layers:
                        item = layers[name]
                        params += [item] if isinstance(item, nn.Parameter) else list(item.parameters())
        return params

    def policy_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters(POLICY)

    def value_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters(CRITIC) + list(self.value_model.score.parameters())

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.policy_parameters() + self.value_parameters()

    def _restore_trainable(self) -> None:
        """peft's set_adapter / disable_adapter mark only the active adapter trainable; PPO trains two adapters."""
        for p in self.trainable_parameters():
            p.requires_grad_(True)
        if self.has_reward:
            for p in self.adapter_parameters(REWARD):
                p.requires_grad_(False)

    @contextmanager
    def adapter(self, name: str):
        """Run with adapter `name` active (its backward too, under gradient checkpointing); restores the previous."""
        previous = self.policy.active_adapter
        if previous != name:
            self.policy.set_adapter(name)
            self._restore_trainable()
        try:
            yield
        finally:
            if previous != name:
                self.policy.set_adapter(previous)
                self._restore_trainable()

    @contextmanager
    def reference(self):
        """Run as the reference: the base with every adapter disabled."""
        with self.adapter(POLICY), self.policy.disable_adapter():
            yield
        self._restore_trainable()

    # -- checkpointing (TRL's unwrap_model_for_generation turns it off to generate and back on without arguments)
    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.policy, "is_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs):
        if gradient_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        self.policy.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=self.gradient_checkpointing_kwargs or {"use_reentrant": False})

    def gradient_checkpointing_disable(self):
        self.policy.gradient_checkpointing_disable()

    # -- forward
    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int = 0, role: str = "both"):
        """role "both" -> (policy logits (B, L', V), values (B, L)); "policy" -> logits; "value" -> values.
        For a backward, call "policy" and "value" separately, each inside its adapter context."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if role not in ("both", "policy", "value"):
            raise ValueError(f"role={role!r} is not one of 'both', 'policy', 'value'.")
        logits = values = None
        if role in ("both", "policy"):
            with self.adapter(POLICY):
                logits = lm_logits(self.policy, inputs, logits_to_keep)
        if role in ("both", "value"):
            values = scalar_head_outputs(self.value_model, inputs)
        return (logits, values) if role == "both" else logits if role == "policy" else values

    # -- saving
    def save_pretrained(self, folder: str) -> None:
        """`folder/policy/` and `folder/critic/` (peft adapters, loadable with PeftModel.from_pretrained(base,
        folder/policy)) and `folder/value_head.safetensors`. The reward adapter is the user's input: not saved."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        self.policy.save_pretrained(folder, selected_adapters=[POLICY, CRITIC])
        save_file({k: v.detach().contiguous().cpu() for k, v in self.value_model.score.state_dict().items()},
                  os.path.join(folder, "value_head.safetensors"))

    def load_trained(self, folder: str) -> None:
        """Restore the policy and critic adapters and the value head written by `save_pretrained`."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        for name in (POLICY, CRITIC):
            path = os.path.join(folder, name, "adapter_model.safetensors")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is missing: not a checkpoint of a shared-base run.")
            result = set_peft_model_state_dict(self.policy, load_file(path), adapter_name=name)
            if result.unexpected_keys:
                raise ValueError(f"adapter {name!r} in {folder} does not match this shared base: unexpected "
                                 f"{result.unexpected_keys[:5]}.")
        self.value_model.score.load_state_dict(load_file(os.path.join(folder, "value_head.safetensors")))


def _lora_copy(config, what: str):
    """A causal-LM copy of a LoraConfig for one adapter of the shared base; LoRA matrices only."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise TypeError(f"{what} must be a peft.LoraConfig, got {type(config).__name__}.")
    extra = [f for f in ("modules_to_save", "trainable_token_indices") if getattr(config, f, None)]
    if extra:
        raise ValueError(f"{what} sets {extra}: a shared base trains LoRA matrices and the heads only (no full "
                         "copies of embeddings or heads). Remove those settings.")
    return dataclasses.replace(copy.deepcopy(config), task_type="CAUSAL_LM", inference_mode=False)


def _load_reward_adapter(reward_adapter):
    """-> (LoraConfig, LoRA state dict, score-head state dict) from a peft folder or (config, state_dict)."""
    if isinstance(reward_adapter, (str, os.PathLike)):
        from peft import PeftConfig
        from safetensors.torch import load_file

        folder = str(reward_adapter)
        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reward_adapter={folder!r} has no adapter_model.safetensors: pass the folder "
                                    "peft's save_pretrained wrote (e.g. RewardTrainer's output with a peft_config).")
        config, state = PeftConfig.from_pretrained(folder), load_file(path)
    elif isinstance(reward_adapter, tuple) and len(reward_adapter) == 2:
        config, state = reward_adapter
    else:
        raise TypeError("reward_adapter must be a folder written by peft's save_pretrained, or a (LoraConfig, "
                        f"state_dict) pair; got {type(reward_adapter).__name__}.")
    head = {}
    lora = {}
    for key, value in state.items():
        short = key.split("base_model.model.", 1)[-1]
        if short.startswith(("score.", "classifier.")):  # the sequence-classification head (modules_to_save)
            head[short.split(".", 1)[1].replace("modules_to_save.default.", "")] = value
        else:
            lora[key] = value
    if "weight" not in head:
        raise ValueError("the reward adapter has no score head (`score.weight`): train it as a sequence-classification "
                         "model (task_type='SEQ_CLS', as RewardTrainer does) so its head is saved with it.")
    if head["weight"].shape[0] != 1:
        raise ValueError(f"the reward adapter's score head has {head['weight'].shape[0]} outputs; a reward model "
                         "has 1.")
    config = dataclasses.replace(copy.deepcopy(config), modules_to_save=None, task_type="CAUSAL_LM",
                                 inference_mode=True)
    return config, lora, head


def build_shared_base(base_model: nn.Module, policy_lora, critic_lora=None, reward_adapter=None,
                      value_head_init: str = "zero") -> SharedBaseModels:
    """One base model for every PPO role (see `SharedBaseModels`).

    Args:
        base_model: a causal LM (`AutoModelForCausalLM`), loaded in 4-bit (nf4), 8-bit or bf16. Its own weights
            are frozen and keep their dtype (unlike peft's prepare_model_for_kbit_training, nothing is upcast to
            fp32: the embeddings and norms are not trained). Gradient checkpointing is turned on by the trainer
            (`PPOConfig.gradient_checkpointing`).
        policy_lora: `peft.LoraConfig` of the policy adapter.
        critic_lora: `LoraConfig` of the critic adapter (default: the policy's).
        reward_adapter: optional frozen reward adapter with its score head, trained on the same base as a
            sequence-classification model (e.g. TRL's RewardTrainer with a peft_config): the folder its
            `save_pretrained` wrote, or a `(LoraConfig, state_dict)` pair in that format.
        value_head_init: "zero" (V = 0 at step 0) or "normal" (std 1/sqrt(H + 1)).

    Returns:
        A `SharedBaseModels`; `.reward_model` is the reward role when `reward_adapter` is given.
    """
    from peft import PeftModel, get_peft_model

    if isinstance(base_model, PeftModel):
        raise ValueError("build_shared_base takes the plain base model, not a PeftModel: merge_and_unload() it or "
                         "pass the model it wraps.")
    if value_head_init not in ("zero", "normal"):
        raise ValueError(f"value_head_init={value_head_init!r} is not one of ('zero', 'normal').")
    disable_bnb_cpu_repack(base_model)
    base_model.requires_grad_(False)
    peft_model = get_peft_model(base_model, _lora_copy(policy_lora, "policy_lora"), adapter_name=POLICY)
    peft_model.add_adapter(CRITIC, _lora_copy(critic_lora if critic_lora is not None else policy_lora, "critic_lora"))

    config = base_model.config.get_text_config() if hasattr(base_model.config, "get_text_config") \
        else base_model.config
    hidden = config.hidden_size
    device = next(p.device for p in base_model.parameters())
    value_head = nn.Linear(hidden, 1, bias=False, device=device, dtype=torch.float32)
    with torch.no_grad():
        if value_head_init == "zero":
            value_head.weight.zero_()
        else:
            value_head.weight.normal_(0.0, 1.0 / (hidden + 1) ** 0.5)

    reward_head = None
    if reward_adapter is not None:
        from peft import set_peft_model_state_dict

        reward_config, lora_state, head_state = _load_reward_adapter(reward_adapter)
        peft_model.add_adapter(REWARD, reward_config)
        result = set_peft_model_state_dict(peft_model, lora_state, adapter_name=REWARD)
        if result.unexpected_keys:
            raise ValueError(f"the reward adapter does not fit this base model: unexpected keys "
                             f"{result.unexpected_keys[:5]}. Train it on the same base architecture.")
        reward_head = nn.Linear(hidden, 1, bias="bias" in head_state, device=device, dtype=torch.float32)
        reward_head.load_state_dict({k: v.float() for k, v in head_state.items()})
    peft_model.set_adapter(POLICY)
    return SharedBaseModels(peft_model, value_head, reward_head)


def is_quantized(model) -> bool:
    """Loaded in 4-bit or 8-bit by bitsandbytes (through a peft wrapper too)."""
    base = _underlying(model) if isinstance(model, nn.Module) else model
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def lora_for_quantized_value_model(value_model, peft_config=None):
    """A 4-bit/8-bit value model without adapters gets LoRA (all linear layers; its `score` head trained as peft's
    modules_to_save) instead of being trained as is: TRL trains such a model's unquantized embeddings, norms and head
    in full (gigabytes of optimizer state on a 7B) while its quantized weights cannot move. The rank follows the
    policy's `peft_config` (r, lora_alpha) if it is a LoraConfig, else r=16, alpha=32. Any other model is returned
    unchanged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if not isinstance(value_model, nn.Module) or isinstance(value_model, PeftModel) or not is_quantized(value_model):
        return value_model
    r, alpha = (peft_config.r, peft_config.lora_alpha) if isinstance(peft_config, LoraConfig) else (16, 32)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="SEQ_CLS")
    print(f"[trl_ext] the value model is quantized: training LoRA (r={r}, all linear layers) and its score head, "
          "not its embeddings and norms")
    return get_peft_model(value_model, config)


def build_value_model(init: str, head_init: str | None, value_model, policy, reward_model):
    """The critic a run trains, chosen by `PPOConfig.value_model_init`:

    - "given": `value_model` as passed (TRL's behaviour);
    - "reward_model": a copy of the reward model, head included (InstructGPT: the critic starts from the RM);
    - "policy": a sequence-classification model of the policy's architecture, its backbone copied from the policy,
      with a fresh 1-output `score` head.

    `head_init` "zero" zeroes the `score` head so V ≈ 0 at step 0 (None: "zero" for a built model, "keep" for a
    given one).
    """
    import copy

    from transformers import AutoModelForSequenceClassification

    if init == "given":
        if value_model is None:
            raise ValueError("No value model: pass `value_model=...`, or set value_model_init='policy' or "
                             "'reward_model' to build one.")
        critic = value_model
    else:
        if value_model is not None:
            raise ValueError(f"value_model_init={init!r} builds the value model, but a `value_model` was passed too: "
                             "pass value_model=None, or set value_model_init='given'.")
        if init == "reward_model":
            if not isinstance(reward_model, nn.Module):
                raise ValueError("value_model_init='reward_model' needs a reward *model*; the reward is a function. "
                                 "Use value_model_init='policy' or pass a value_model.")
            critic = copy.deepcopy(reward_model)
        else:  # "policy"
            if is_quantized(policy):
                raise ValueError("value_model_init='policy' cannot copy a quantized policy's backbone; pass a "
                                 "value_model.")
            if hasattr(policy, "merge_and_unload"):  # a PeftModel: the backbone with its adapter merged in
                base = copy.deepcopy(policy).merge_and_unload()
            else:
                base = policy
            config = copy.deepcopy(base.config)
            config.num_labels = 1
            critic = AutoModelForSequenceClassification.from_config(config)
            backbone = getattr(base, base.base_model_prefix)
            getattr(critic, critic.base_model_prefix).load_state_dict(backbone.state_dict())
            critic.to(dtype=next(base.parameters()).dtype, device=next(base.parameters()).device)
        if getattr(critic.config, "pad_token_id", None) is None:  # 0 is a pad id like any other
            critic.config.pad_token_id = policy.config.pad_token_id
    if (head_init or ("keep" if init == "given" else "zero")) == "zero":
        with torch.no_grad():
            for p in critic.score.parameters():
                p.zero_()
    return critic


def freeze_backbone(value_model: nn.Module, trainable_layers: int) -> None:
    """Leave only the top `trainable_layers` decoder layers, the final norm and the `score` head of a
    sequence-classification model trainable (-1: all of it), in fp32 (AdamW on bf16 weights loses small updates; over
    a bf16 backbone the two then meet under bf16 autocast, PPOConfig bf16=True). On CPU a SmolLM2 critic with 2 of 30
    layers trained takes about half the time per PPO step of a fully trained one."""
    if trainable_layers < 0:
        return
    backbone = getattr(value_model, value_model.base_model_prefix)
    layers = getattr(backbone, "layers", None)
    if layers is None or not hasattr(backbone, "norm") or not hasattr(value_model, "score"):
        raise ValueError(f"freeze_backbone: {type(value_model).__name__} has no `{value_model.base_model_prefix}"
                         ".layers`/`.norm` and `score` head (a Llama-style sequence classifier); pass -1 to train "
                         "all of it.")
    value_model.requires_grad_(False)
    trainable = [value_model.score, backbone.norm] + (list(layers[len(layers) - trainable_layers:])
                                                      if trainable_layers else [])
    for module in trainable:
        module.requires_grad_(True)
        module.float()
