"""The critic and the trained module: value-head outputs, the policy+value wrapper the optimizer trains, the value
model built from the policy, the reward model or as given, and the critic's frozen trunk (`FrozenTrunk`: its
embeddings and lower layers run once per rollout).

Shapes: B = batch, L = sequence length, H = hidden size.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from .forward import _underlying, lm_logits, sequence_inputs
from .preparation import is_checkpointing, is_quantized, set_checkpointing


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
    Keeps TRL's attribute names (`policy`, `value_model`) so TRL's own helpers work on it; `config`, `generate`,
    `save_pretrained` and `push_to_hub` are the policy's, as a GRPOTrainer script reads `trainer.model`."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.gradient_checkpointing_kwargs: dict | None = None
        self.trunk: FrozenTrunk | None = None  # set by the trainer where the engine allows (PPOTrainer)

    @property
    def _no_split_modules(self) -> list[str]:
        """The policy's and the value model's layer classes: FSDP's TRANSFORMER_BASED_WRAP shards each such layer on
        its own (accelerate reads this when the config names no class)."""
        names = []
        for module in (self.policy, self.value_model):
            names += [n for n in getattr(_underlying(module), "_no_split_modules", None) or [] if n not in names]
        return names

    # What a GRPOTrainer script calls on `trainer.model`, there the policy: here the policy's too
    def generate(self, *args, **kwargs):
        return self.policy.generate(*args, **kwargs)

    def save_pretrained(self, *args, **kwargs):
        return self.policy.save_pretrained(*args, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        return self.policy.push_to_hub(*args, **kwargs)

    def policy_parameters(self) -> list[nn.Parameter]:
        return list(self.policy.parameters())

    def value_parameters(self) -> list[nn.Parameter]:
        return list(self.value_model.parameters())

    # TRL's `unwrap_model_for_generation` turns checkpointing off while generating (it breaks the KV cache) and back
    # on with no arguments afterwards: the kwargs given first (use_reentrant=False) are remembered for that.
    @property
    def is_gradient_checkpointing(self) -> bool:
        return is_checkpointing(self.policy)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs):
        if gradient_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        for module in (self.policy, self.value_model):
            if getattr(module, "supports_gradient_checkpointing", False):
                set_checkpointing(module, True, self.gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        for module in (self.policy, self.value_model):
            if getattr(module, "supports_gradient_checkpointing", False):
                set_checkpointing(module, False)

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int = 0, role: str = "both",
                trunk_hidden: torch.Tensor | None = None):
        """-> (policy logits (B, L', V), values (B, L)); L' = `logits_to_keep` where the policy supports it.
        role="value": the values alone (a rollout whose π_old is the sampler's, `PPOConfig.rollout_logprobs`);
        role="policy": the logits alone (critic warmup's gradient-free policy pass).
        trunk_hidden: the output of the critic's frozen trunk (`trunk`, kept by the rollout): only the
        critic's layers above it run."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if role not in ("both", "value", "policy"):
            raise ValueError(f"role={role!r} is not one of 'both', 'value', 'policy'.")
        if role == "policy":
            return lm_logits(self.policy, inputs, logits_to_keep)
        values = scalar_head_outputs(self.value_model, inputs, self.trunk, trunk_hidden)
        return values if role == "value" else (lm_logits(self.policy, inputs, logits_to_keep), values)


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
                raise ValueError("value_model_init='policy' (also what an unset value_model_init builds when no "
                                 "value_model is passed) cannot copy a quantized policy's backbone: pass a "
                                 "peft_config (one shared 4-bit base is then made for the policy, the critic and "
                                 "the reference, as trl_ext.models.build_shared_base builds it), or a value_model.")
            if hasattr(policy, "merge_and_unload"):  # a PeftModel: the backbone with its adapter merged in
                base = copy.deepcopy(policy).merge_and_unload()
            else:
                base = policy
            config = copy.deepcopy(base.config)
            config.num_labels = 1
            with torch.random.fork_rng(devices=[]):  # its throwaway random init leaves the run's stream (the LoRA
                critic = AutoModelForSequenceClassification.from_config(config)  # matrices come next) as it was
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
