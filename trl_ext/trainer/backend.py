"""The engine and the model layout: `Backend` (decided once at set-up; the trainer asks it, never branches on the
engine) and `Reference` (which model acts as the reference). Model plumbing only, no PPO math. The helpers below are
what trl_ext does differently under DeepSpeed (ZeRO-2/3) and FSDP2:

- `deepspeed_batch_config`: DeepSpeed sizes its engine from a prepared dataloader or from its batch keys; the
  trainer's rollout dataloader yields whole rollout batches, so the keys are set from the PPO batch sizes, and
  DeepSpeed's own clipping (one norm over the policy and the critic together) is turned off: trl_ext clips each.
- `clip_role_grads_`: the policy's or the critic's gradients, read and rescaled where the engine keeps them: under
  ZeRO each process's part of the reduced gradients (not `p.grad`), the norm summed over processes; `p.grad` under
  DDP and FSDP2 (DTensors).
- `average_gradients_`: a shared 4-bit base on several processes is not wrapped in DDP (it runs two backward passes
  per micro-batch, one per adapter); its trained gradients are averaged once per optimizer step instead.
- `frozen_groups`: critic warmup under DeepSpeed: the engine steps every parameter group, so the policy's groups
  take that step at learning rate 0 on zero gradients, and their optimizer state is dropped after it (the next real
  step starts Adam afresh, as when torch skips a parameter without a gradient).
- `fsdp2_unsharded`: FSDP2 keeps each parameter sharded except inside the forward of the module that owns it;
  generation, the reference pass through the policy's disabled adapter and evaluation call the policy directly, so
  every FSDP2 module's parameters are gathered for their length (what TRL does for ZeRO-3 generation).
- `reference_copy`: a frozen deep copy, what TRL's `create_reference_model` makes (that helper is deprecated at
  TRL's top level and lives in `trl.experimental`, so trl_ext does not import it); a policy ZeRO-3 partitioned as it
  loaded cannot be deep-copied: the copy is built from its config, partitioned, and its weights gathered.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import warnings
from contextlib import contextmanager, nullcontext

import torch
from accelerate.utils import DistributedType
from torch import nn
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from ..data.batches import token_budget_groups
from ..models import SharedBaseModels, is_quantized


def deepspeed_batch_config(ds_config: dict, micro_batch: int, accumulation: int, processes: int,
                           max_grad_norm: float | None) -> None:
    """Fill the DeepSpeed config's batch keys (one engine step per PPO minibatch) and turn its clipping off. A value
    the config sets that contradicts the PPO settings is an error, not a silent change."""
    wanted = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "train_batch_size": micro_batch * accumulation * processes}
    for key, value in wanted.items():
        given = ds_config.get(key, "auto")
        if given != "auto" and int(given) != value:
            raise ValueError(f"The DeepSpeed config sets {key}={given}, but this PPO run needs {value} (one engine "
                             "step per minibatch of per_device_train_batch_size x gradient_accumulation_steps / "
                             f"num_mini_batches rows): set it to 'auto' or drop it, and size the batch with "
                             "PPOConfig's fields.")
        ds_config[key] = value
    clip = ds_config.get("gradient_clipping", "auto")
    if clip != "auto" and float(clip) not in (0.0, float(max_grad_norm or 0.0)):
        raise ValueError(f"The DeepSpeed config sets gradient_clipping={clip}, but trl_ext clips the policy and the "
                         f"critic each to max_grad_norm={max_grad_norm}: set gradient_clipping to 'auto' (or drop "
                         "it) and choose the norm with --max_grad_norm.")
    ds_config["gradient_clipping"] = 0.0  # trl_ext clips per role (see clip_role_grads_)


def clip_role_grads_(params: list[nn.Parameter], max_norm: float, deepspeed: bool, loss_scale: float = 1.0,
                     drop: bool = False, device: torch.device | None = None) -> float:
    """Clip one role's gradients in place to `max_norm` (inf: no clipping) as `torch.nn.utils.clip_grad_norm_`
    does, and return their pre-clip norm (unscaled by `loss_scale`, DeepSpeed's fp16 loss scale). `drop`: critic
    warmup, the policy's gradients go (None; under DeepSpeed zeros) and the norm is 0. `device`: the training
    device, where a process holding no part of this role puts its zero for the all-reduce (NCCL takes GPU tensors
    only)."""
    if not deepspeed:
        if drop:
            for p in params:
                p.grad = None  # torch optimizers skip parameters without a gradient
            return 0.0
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    params = [p for p in params if p.requires_grad]
    # each process's part of each reduced gradient (ZeRO-3: its partition, DeepSpeed's local API; ZeRO-1/2: its
    # fragment, read as DeepSpeed's own full-gradient accessor reads it), the norm summed over the processes: the
    # full-gradient accessors all-reduce every parameter once more per step, and the ZeRO-3 setter fails on padded
    # partitions
    partial = True
    if any(hasattr(p, "ds_id") for p in params):
        local = [(g, functools.partial(safe_set_local_grad, p)) for p in params
                 if (g := safe_get_local_grad(p)) is not None]
    elif any(p.grad is not None for p in params):  # whole reduced gradients in p.grad (ZeRO-1), read first as
        local, partial = [(p.grad, p.grad.copy_) for p in params if p.grad is not None], False  # DeepSpeed does
    else:
        local = [(g, g.copy_) for p in params if (g := _zero12_local_grad(p)) is not None]
    if drop:
        for g, set_ in local:
            set_(torch.zeros_like(g))
        return 0.0
    square = (torch.stack([g.float().pow(2).sum() for g, _ in local]).sum() if local
              else torch.zeros((), device=device))
    if partial:
        torch.distributed.all_reduce(square)  # every process, also one holding no part of this role
    norm = square.sqrt() / loss_scale
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g, set_ in local:
        set_(g * coef.to(g.dtype))
    return norm.item()


def _zero12_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This process's fragment of a ZeRO-1/2 parameter's reduced gradient (a view: writing it writes the gradient
    DeepSpeed steps with), or None if another process holds all of it. DeepSpeed's `get_full_hp_grad` reads the same
    fragment and all-reduces it into a whole gradient."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).view(-1)
    if fragment.numel() == param.numel():  # a whole buffer on each process (bf16 optimizer): this process's part
        address = mapping.lp_fragment_address
        fragment = fragment.narrow(0, address.start, address.numel)
    return fragment


def _fp32_partitions(zero_optimizer, group: int) -> list[torch.Tensor]:
    """The fp32 tensors DeepSpeed's ZeRO optimizer steps for param group `group` (the keys of their Adam state)."""
    if hasattr(zero_optimizer, "sub_group_to_group_id"):  # ZeRO-3: the group's sub-groups, put in only to step
        return [zero_optimizer.fp32_partitioned_groups_flat[sub] for sub, g in
                zero_optimizer.sub_group_to_group_id.items() if g == group]
    return list(zero_optimizer.optimizer.param_groups[group]["params"])  # ZeRO-1/2: its flat fp32 partition


def average_gradients_(params: list[nn.Parameter], reduce) -> None:
    """Average the gradients of `params` over the processes in place, in one flat all-reduce: a shared 4-bit base's
    adapters and heads, which are not wrapped in DDP. `reduce`: `accelerator.reduce`. Every process holds the same
    parameters with a gradient (in critic warmup the policy's have none anywhere)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(part.view_as(g))


@contextmanager
def frozen_groups(zero_optimizer, groups: list[int], active: bool, drop_state: bool = True):
    """Inside: the listed param groups of DeepSpeed's ZeRO optimizer step at learning rate 0 (their gradients are
    zero); after: their optimizer state is dropped (`drop_state`), so warmup leaves no trace in it."""
    if not active:
        yield
        return
    torch_groups = zero_optimizer.optimizer.param_groups
    saved = [torch_groups[i]["lr"] for i in groups]
    for i in groups:
        torch_groups[i]["lr"] = 0.0
    try:
        yield
    finally:
        for i, lr in zip(groups, saved):
            torch_groups[i]["lr"] = lr
            for p in _fp32_partitions(zero_optimizer, i) if drop_state else ():
                zero_optimizer.optimizer.state.pop(p, None)


def group_roles(optimizer: torch.optim.Optimizer, policy_params, value_params) -> list[str]:
    """'policy', 'value' or 'mixed' for each param group (read before DeepSpeed replaces the groups' tensors)."""
    policy_ids, value_ids = {id(p) for p in policy_params}, {id(p) for p in value_params}
    roles = []
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        roles.append("policy" if ids <= policy_ids else "value" if ids <= value_ids else "mixed")
    return roles


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def fsdp2_unsharded(model: nn.Module):
    """Every FSDP2 module of `model` holds its whole parameters inside (no resharding after each forward); all
    resharded after. A no-op for a model FSDP2 does not shard."""
    modules = _fsdp2_modules(model)
    if not modules:
        yield
        return
    # FSDP2 takes the first module to run forward as its root; before any forward, tell it which one that is
    # (torch has no public call for it: `fully_shard`'s state does this in the root's first pre-forward)
    modules[0]._get_fsdp_state()._lazy_init()
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def reference_copy(policy: nn.Module) -> nn.Module:
    """A frozen copy of the policy (TRL's `create_reference_model`): a deep copy of a policy each process holds whole
    (under ZeRO-3 trl_ext partitions it with the other frozen models), or, for a policy partitioned as it loaded, a
    model built from its config, partitioned, with each weight gathered from the policy."""
    if not is_deepspeed_zero3_enabled() or not any(hasattr(p, "ds_id") for p in policy.parameters()):
        ref = copy.deepcopy(policy)
    else:
        import deepspeed

        dtype = next(policy.parameters()).dtype
        ref = type(policy)._from_config(policy.config, dtype=dtype)  # partitioned as it is built (zero.Init)
        own, source = dict(ref.named_parameters()), dict(policy.named_parameters())
        if own.keys() != source.keys():
            raise ValueError("Under ZeRO-3 the reference is built from the policy's config, and that model has "
                             f"other parameters than the policy ({sorted(own.keys() ^ source.keys())[:3]}): pass "
                             "ref_model (e.g. from_pretrained of the policy's checkpoint).")
        for name, param in own.items():
            with deepspeed.zero.GatheredParameters([param, source[name]], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    param.data.copy_(source[name].data)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


def finite_or_inf(max_grad_norm: float | None) -> float:
    return max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else math.inf


class Backend:
    """The engine (one process, DDP, DeepSpeed ZeRO-1/2/3, FSDP2) and the model layout (separate policy and value
    models, or one shared base), read once from the Accelerator at set-up. The trainer and its phases ask it for
    backward, clipping, the optimizer step, gathering, unwrapping and whole weights; nothing else branches on the
    engine.

    After `prepare`, `model` is the trained module as the engine wraps it (DDP, the DeepSpeed engine, FSDP2 modules,
    or unwrapped) and `optimizer` its optimizer."""

    def __init__(self, accelerator, shared: SharedBaseModels | None, max_grad_norm: float | None):
        state = accelerator.state
        plugin = getattr(state, "deepspeed_plugin", None)
        self.accelerator = accelerator
        self.deepspeed = plugin is not None
        self.fsdp = getattr(state, "fsdp_plugin", None) is not None
        self.params_sharded = self.fsdp or (plugin is not None and plugin.zero_stage == 3)  # ZeRO-3 or FSDP
        self.shared = shared  # the layout: one shared 4-bit base for every role, or None
        self.num_processes = accelerator.num_processes
        # one plain process: no reducer needs every parameter to get a gradient (critic warmup may skip the policy's)
        self.plain = accelerator.distributed_type == DistributedType.NO
        self.max_norm = finite_or_inf(max_grad_norm)
        self.model = self.optimizer = None
        self.group_roles: list[str] = []

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # ------------------------------------------------------------------------------------------------ set-up
    def check_shared_base(self) -> None:
        """A shared base on several processes: plain data parallel only (bitsandbytes' 4-bit weights cannot be
        sharded), every process holding the base on its own device."""
        if self.shared is None or self.num_processes == 1:
            return
        if self.deepspeed or self.fsdp:
            raise ValueError("A shared 4-bit base cannot be sharded by DeepSpeed or FSDP (bitsandbytes' quantized "
                             "weights): launch plain data parallel (`accelerate launch --multi_gpu "
                             "--num_processes N`), each process holding the base, or one process.")
        device = self.device
        devices = {p.device for p in self.shared.parameters()}
        if any(d.type != device.type or (d.type != "cpu" and d.index != device.index) for d in devices):
            raise ValueError(f"The shared base is on {sorted(map(str, devices))} but this process trains on "
                             f"{device}: load the base on each process's own device (e.g. "
                             "`device_map={'': PartialState().local_process_index}` in from_pretrained).")

    def check_quantized(self, model: nn.Module) -> None:
        """A 4-bit/8-bit policy or critic of the separate layout under DeepSpeed or FSDP: refused, as a shared base is
        (the engines flatten, cast and shard every parameter, bitsandbytes' packed weights included)."""
        if self.shared is not None or not (self.deepspeed or self.fsdp):
            return
        quantized = [role for role in ("policy", "value_model") if is_quantized(getattr(model, role, None))]
        if quantized:
            engine = "DeepSpeed" if self.deepspeed else "FSDP"
            raise ValueError(f"The {' and the '.join(quantized)} is loaded in 4-bit/8-bit, and bitsandbytes' "
                             f"quantized weights cannot be sharded by {engine}: launch plain data parallel "
                             "(`accelerate launch --multi_gpu --num_processes N`, each process holding its 4-bit "
                             "model), or load the model unquantized (drop --load_in_4bit) to shard it.")

    def check_precision(self, model: nn.Module, fp16: bool, bf16: bool) -> None:
        """Mixed precision trains fp32 weights: under fp16 a GradScaler unscales the gradients, and it refuses fp16
        ones at the first optimizer step (after a whole rollout), so fp16 trained weights are refused here; bf16
        trained weights get a warning (AdamW steps in bf16 lose the updates smaller than bf16's resolution). DeepSpeed
        keeps its own fp32 master weights and is not checked."""
        if self.deepspeed:
            return
        trained = {p.dtype for p in model.parameters() if p.requires_grad}
        if fp16 and self.accelerator.scaler is None:
            raise ValueError(f"fp16=True on {self.device.type}: accelerate runs fp16 mixed precision (autocast and "
                             "a GradScaler) on GPUs only. On CPU use bf16=True with use_cpu=True, or fp32 "
                             "(fp16=False).")
        if fp16 and torch.float16 in trained:
            raise ValueError("fp16=True with trained weights in float16: the GradScaler cannot unscale fp16 gradients "
                             "(\"Attempting to unscale FP16 gradients\" at the first step). Load the trained models in "
                             "float32 (dtype=torch.float32; the Accelerator's autocast computes in fp16), or train a "
                             "LoRA adapter (peft keeps it in fp32) on an fp16 or 4-bit base.")
        if bf16 and torch.bfloat16 in trained:
            warnings.warn("bf16=True with trained weights in bfloat16: AdamW then steps in bf16, where an update "
                          "smaller than 1/256 of a weight is lost (at learning rates ~1e-6 most are). Load the trained "
                          "models in float32 (the Accelerator's autocast computes in bf16), or train a LoRA adapter.",
                          stacklevel=4)

    def prepare(self, model: nn.Module, optimizer, args) -> None:
        """Wrap the trained module and its optimizer for the engine (`accelerator.prepare`); under DeepSpeed first
        size its batch from the PPO batch (`deepspeed_batch_config`). A shared base on several processes is not
        wrapped in DDP: each process holds the 4-bit base, and the trained gradients are averaged before each
        optimizer step (`clip_gradients`); DDP's reducer would reduce once per backward, and a shared base runs two
        per micro-batch (one per adapter)."""
        accelerator = self.accelerator
        self.check_shared_base()
        self.check_quantized(model)
        self.check_precision(model, args.fp16, args.bf16)
        self.group_roles = group_roles(optimizer, model.policy_parameters(), model.value_parameters())
        if self.deepspeed:
            deepspeed_batch_config(accelerator.state.deepspeed_plugin.deepspeed_config,
                                   args.per_device_train_batch_size, accelerator.gradient_accumulation_steps,
                                   self.num_processes, args.max_grad_norm)
            if args.critic_warmup_steps and "mixed" in self.group_roles:
                raise ValueError("critic_warmup_steps under DeepSpeed freezes the policy's optimizer groups, but a "
                                 "param group of your optimizer holds both policy and value parameters: give them "
                                 "separate groups, or let trl_ext build the optimizer.")
        if self.shared is not None and self.num_processes > 1:
            self.model, self.optimizer = model, accelerator.prepare(optimizer)
        else:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # accelerate wraps the module's forward in autocast and a conversion of every output to fp32: a second,
        # fp32 copy of the (b, T+1, V) logits beside the bf16 ones. Its own forward back (in place); the phases call it
        # under `autocast()` and upcast what they need (the log-probs chunk by chunk, the values).
        accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)

    def place_frozen(self, module: nn.Module) -> nn.Module:
        """A frozen model (the reference, a reward model): wrapped for DeepSpeed inference (ZeRO-3 partitions it),
        or moved to the training device. A module without parameters (a rule-based reward) is only moved."""
        if self.deepspeed and any(True for _ in module.parameters()):
            from trl.models import prepare_deepspeed

            return prepare_deepspeed(module, self.accelerator)
        return module.to(self.device)

    # ------------------------------------------------------------------------------------------------ access
    def autocast(self):
        """Inside: the mixed precision of the run (bf16/fp16 autocast; a no-op in fp32 and under DeepSpeed, whose
        engine holds the model in its dtype). Every forward of the trained module runs inside it, on any layout."""
        return self.accelerator.autocast()

    def unwrap(self) -> nn.Module:
        """The policy+value wrapper (or the shared base) without its engine's shell."""
        return self.accelerator.unwrap_model(self.model)

    def whole_weights(self):
        """Inside: FSDP2's parameters gathered, for code that calls the policy directly (generation, the reference
        through the disabled adapter, evaluation); a no-op elsewhere. Under FSDP2 every process must enter it."""
        return fsdp2_unsharded(self.model)

    def generation_model(self, gather_zero3: bool):
        """Inside: the unwrapped trained module to generate with; under ZeRO-3 with its weights gathered if
        `gather_zero3` (TRL's `ds3_gather_for_generation`)."""
        from trl.models import unwrap_model_for_generation

        return unwrap_model_for_generation(self.model, self.accelerator, gather_deepspeed3_params=gather_zero3)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """(n, ...) on each process -> (n · processes, ...): rows of all processes."""
        return self.accelerator.gather(tensor.to(self.device))

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def token_groups(self, lengths: list[int], budget: int) -> list[list[int]]:
        """`data.token_budget_groups` with as many groups on every process (the largest count): their forwards and
        backwards meet in collectives (DDP's buffers and gradients, ZeRO-3's and FSDP's gathered weights)."""
        groups = len(token_budget_groups(lengths, budget))
        if self.num_processes > 1:
            groups = int(self.gather(torch.tensor([groups])).max())
        return token_budget_groups(lengths, budget, groups)

    @contextmanager
    def accumulate(self, last: bool):
        """One micro-batch of a minibatch split into a number of micro-batches known here, not to accelerate
        (`max_tokens_per_micro_batch`): gradients are synchronised and the optimizer may step at the `last` one
        only, as `accelerator.accumulate` does for a fixed count."""
        self.accelerator.gradient_state._set_sync_gradients(last)
        with nullcontext() if last else self.accelerator.no_sync(self.model):
            yield

    def barrier(self) -> None:
        if self.num_processes > 1:
            self.accelerator.wait_for_everyone()

    def any_process(self):
        """Several processes: (a flag on this process) -> whether any process has it set (a collective every process
        calls as often); one process: None (nothing to ask)."""
        if self.num_processes == 1:
            return None

        def any_set(flag: bool) -> bool:
            return bool(self.sum_over_processes(torch.tensor(float(flag), device=self.device)).item())

        return any_set

    # ------------------------------------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor) -> None:
        """accelerate's backward, except under DeepSpeed: accelerate's DeepSpeed backward also steps the engine,
        and trl_ext clips each role's gradients before that step (`optimizer_step`)."""
        if self.deepspeed:
            self.model.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
            self.model.backward(loss)  # divides by the engine's accumulation steps, as accelerate does
        else:
            self.accelerator.backward(loss)

    def clip_gradients(self, critic_only: bool) -> dict[str, float]:
        """Before an optimizer step: drop the policy's gradients in critic warmup; then clip the policy's and the
        critic's gradients each to `max_grad_norm` on its own (one joint norm lets the critic's gradient throttle the
        policy's step). Returns each pre-clip norm. Under fp16 the gradients are unscaled first (DeepSpeed: the norm
        is divided by its loss scale, and the engine unscales when it steps)."""
        wrapper = self.unwrap()
        loss_scale = float(getattr(self.model.optimizer, "loss_scale", 1.0)) if self.deepspeed else 1.0
        if not self.deepspeed:
            self.accelerator.unscale_gradients()
        if self.shared is not None and self.num_processes > 1:
            average_gradients_(self.shared.trainable_parameters(), self.accelerator.reduce)
        return {key: clip_role_grads_(params, self.max_norm, self.deepspeed, loss_scale, drop, self.device)
                for key, params, drop in (("policy/grad_norm", wrapper.policy_parameters(), critic_only),
                                          ("val/grad_norm", wrapper.value_parameters(), False))}

    def optimizer_step(self, critic_only: bool, skip: bool = False) -> None:
        """After `clip_gradients`: the optimizer step (under DeepSpeed the engine's, with the policy's groups frozen
        in critic warmup: `frozen_groups`). `skip` (a non-finite update): the gradients are dropped and the weights
        and Adam's moments are left as they are; under DeepSpeed, whose engine must step at each accumulation
        boundary, it steps every group at learning rate 0 on zero gradients: the weights stay, Adam's moments decay
        by one step."""
        if skip:
            self._skip_step()
            return
        if self.deepspeed:
            policy_groups = [i for i, role in enumerate(self.group_roles) if role == "policy"]
            with frozen_groups(self.model.optimizer, policy_groups, critic_only):
                self.model.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def _skip_step(self) -> None:
        if self.deepspeed:
            wrapper = self.unwrap()
            for params in (wrapper.policy_parameters(), wrapper.value_parameters()):
                clip_role_grads_(params, self.max_norm, True, drop=True, device=self.device)
            with frozen_groups(self.model.optimizer, list(range(len(self.group_roles))), True, drop_state=False):
                self.model.step()
            return
        self.optimizer.zero_grad()
        if self.accelerator.scaler is not None:  # fp16: close the GradScaler's step (its unscale_ was recorded)
            self.accelerator.scaler.update()

    def trained_weights_finite(self) -> bool:
        """Whether every trained parameter and every optimizer state tensor this process holds is finite, on all
        processes (each checks its own shards; a collective where there are several)."""
        tensors = [getattr(p, "ds_tensor", p) for p in self.unwrap().parameters() if p.requires_grad]
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if not self.deepspeed:
            tensors += [v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.is_floating_point()]
        tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2: the local shards
        bad = torch.zeros((), device=self.device)
        for t in tensors:
            if t.numel():
                bad += (~torch.isfinite(t.detach())).any().to(self.device)
        return float(self.sum_over_processes(bad)) == 0

    def policy_weights_norm(self) -> float:
        """The L2 norm of the policy's trained weights over all processes, in float64 (weights near fp32's limit still
        give a finite norm; a non-finite weight gives a non-finite one): under ZeRO-3 and FSDP2 each process's shards,
        summed (a collective); elsewhere each process holds them whole."""
        tensors = [getattr(p, "ds_tensor", p) for p in self.unwrap().policy_parameters() if p.requires_grad]
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: the local shard
            if t.numel():
                square += torch.linalg.vector_norm(t.detach(), dtype=torch.float64).to(self.device) ** 2
        if self.params_sharded:
            square = self.sum_over_processes(square)
        return float(square.sqrt())

    # ------------------------------------------------------------------------------------------------ saving
    def checkpoint_engine(self) -> dict:
        """How this engine writes a checkpoint (`checkpoint.layout_record`): its name, the family of files (one
        family resumes another: a plain process's and DDP's are the same), and why the files are split per process
        (None: whole, so a checkpoint resumes on any number of processes)."""
        if self.deepspeed:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            return {"name": f"DeepSpeed ZeRO-{stage}", "files": "deepspeed",
                    "per_process": f"DeepSpeed ZeRO-{stage} wrote one optimizer state file per process"}
        if self.fsdp:
            from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

            kind = self.accelerator.state.fsdp_plugin.state_dict_type
            if kind == StateDictType.FULL_STATE_DICT:
                return {"name": "FSDP2 (FULL_STATE_DICT)", "files": "fsdp2-full", "per_process": None}
            return {"name": f"FSDP2 ({kind.name})", "files": "fsdp2-sharded",
                    "per_process": f"FSDP2's {kind.name} wrote one shard per process (FULL_STATE_DICT, as the shipped "
                                   "fsdp.yaml, writes whole files)"}
        return {"name": "DDP" if self.num_processes > 1 else "one process", "files": "whole", "per_process": None}

    def layout_settings(self) -> dict:
        """What a checkpoint records of the layout, which a resumed run must share (`checkpoint.run_settings`)."""
        return {"shared_base": True} if self.shared is not None else {}

    def save_roles(self, folder: str, tokenizer, save_policy, with_value_model: bool) -> None:
        """The trained models into `folder` (every process calls this): a shared base's adapters and value head
        (`policy/`, `critic/`, `value_head.safetensors`) and the tokenizer; otherwise the policy (its adapter, with
        peft) by `save_policy(folder, state_dict)` and, if asked, the value model into `folder/value_model`. Under
        ZeRO-3 and FSDP2 the whole weights are gathered first (a collective); elsewhere each process holds them."""
        from .checkpoint import VALUE_MODEL_DIR

        if self.shared is not None:
            if self.accelerator.is_main_process:
                self.shared.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            return
        policy_state, value_state = self.role_state_dicts()  # a collective under ZeRO-3 and FSDP2
        if not self.accelerator.is_main_process:
            return
        save_policy(folder, policy_state)
        if with_value_model:
            self.unwrap().value_model.save_pretrained(os.path.join(folder, VALUE_MODEL_DIR), state_dict=value_state)

    def load_trained(self, checkpoint: str, is_peft: bool) -> None:
        """The trained weights of a checkpoint that the engine did not restore itself: a shared base's adapters and
        heads, or the policy's and the value model's (`checkpoint.load_trained_weights`)."""
        from .checkpoint import load_trained_weights

        if self.shared is not None:
            self.shared.load_trained(checkpoint)
        else:
            load_trained_weights(self.unwrap(), checkpoint, is_peft)

    def role_state_dicts(self) -> tuple[dict | None, dict | None]:
        """(policy, value model) state dicts to save on the main process: gathered whole from the shards under
        ZeRO-3 and FSDP2 (a collective: every process calls this), None where each process holds the weights."""
        if not self.params_sharded:
            return None, None
        full = self.accelerator.get_state_dict(self.model)  # the main process gets the whole weights
        if not self.accelerator.is_main_process:
            return None, None
        return ({k[len("policy."):]: v for k, v in full.items() if k.startswith("policy.")},
                {k[len("value_model."):]: v for k, v in full.items() if k.startswith("value_model.")})

    def load_engine_checkpoint(self, checkpoint: str) -> bool:
        """Restore the weights (and DeepSpeed's optimizer state) from the engine's own files in a checkpoint; False
        where the engine keeps none (one process, DDP), and the caller loads the saved weights."""
        if self.deepspeed:  # weights, fp32 master weights, optimizer state
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model, checkpoint)
            return True
        if self.fsdp:  # FSDP's own files (Trainer's _save_optimizer_and_scheduler wrote them)
            from accelerate.utils import load_fsdp_model

            load_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, self.model, checkpoint)
            return True
        return False

    def load_fsdp2_optimizer(self, optimizer, checkpoint: str) -> None:
        """FSDP2's optimizer state from the files accelerate's `save_fsdp_optimizer` wrote, as its
        `load_fsdp_optimizer` reads them but not strict: torch refuses by default a state that lacks a trainable
        parameter, and a checkpoint from the critic warmup has none for the policy (Adam creates a parameter's state
        at its first step). torch fills the missing ones with the state of a zero step (`_init_optim_state`: Adam's
        step 1); they are dropped, so those parameters start their state at their first step, as in a run never
        stopped."""
        import torch.distributed.checkpoint as dcp
        from accelerate.utils.constants import OPTIMIZER_NAME
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

        plugin, optimizer = self.accelerator.state.fsdp_plugin, getattr(optimizer, "optimizer", optimizer)
        full = plugin.state_dict_type == StateDictType.FULL_STATE_DICT
        rank0_only = getattr(plugin.state_dict_config, "rank0_only", False)
        options = StateDictOptions(full_state_dict=full, strict=False, broadcast_from_rank0=rank0_only,
                                   cpu_offload=getattr(plugin.state_dict_config, "offload_to_cpu", False))
        if full:  # one file, read by the main process alone when it broadcasts
            state = (torch.load(os.path.join(checkpoint, f"{OPTIMIZER_NAME}.bin"), weights_only=True)
                     if self.accelerator.is_main_process or not rank0_only else {})
            saved = [sorted(state.get("state", {}))]  # the parameters (names) the checkpoint holds a state for
            if self.accelerator.num_processes > 1 and rank0_only:
                from accelerate.utils import broadcast_object_list

                broadcast_object_list(saved)
        else:  # torch.distributed.checkpoint's shards, into the state of every parameter (a zero step's where none)
            reader = dcp.FileSystemReader(os.path.join(checkpoint, f"{OPTIMIZER_NAME}_0"))
            prefix = "optimizer.state."
            saved = [sorted({key[len(prefix):].rsplit(".", 1)[0] for key in reader.read_metadata().state_dict_metadata
                             if key.startswith(prefix)})]
            state = {"optimizer": get_optimizer_state_dict(self.model, optimizer, options=options)}
            dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
            state = state["optimizer"]
        self._set_optimizer_state(self.model, optimizer, state, saved[0], options, checkpoint)

    def load_whole_files(self, checkpoint: str, saved: dict, optimizer, is_peft: bool) -> None:
        """Another engine's checkpoint whose files are whole (`checkpoint.readable`: a plain process's or DDP's,
        FSDP2's FULL_STATE_DICT), as this engine holds the state: the weights from its `save_pretrained` folders
        (under FSDP2 sharded as they load), the optimizer state by parameter name, not strict (as
        `load_fsdp2_optimizer`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from .checkpoint import check_loaded, whole_optimizer_state, whole_weights

        wrapper, optimizer = self.unwrap(), getattr(optimizer, "optimizer", optimizer)
        if self.fsdp:
            weights = whole_weights(checkpoint, is_peft, saved["engine"])
            result = set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True,
                                                                                         strict=False))
            check_loaded(self.model, weights, result, checkpoint)
        else:
            self.load_trained(checkpoint, is_peft)
        state = whole_optimizer_state(checkpoint, saved["files"], optimizer, wrapper)
        self._set_optimizer_state(self.model if self.fsdp else wrapper, optimizer, state, sorted(state["state"]),
                                  StateDictOptions(full_state_dict=True, strict=False), checkpoint)

    @staticmethod
    def _set_optimizer_state(model: nn.Module, optimizer, state: dict, saved: list[str], options,
                             checkpoint: str) -> None:
        """Load a state keyed by parameter names (`saved`: those it holds a state for); the parameters it has none for
        lose the zero-step state torch fills in, so they start theirs at their first step."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=options)
        params = dict(model.named_parameters())
        unknown = sorted(set(saved) - set(params))
        if unknown:
            raise ValueError(f"The optimizer state in {checkpoint} names parameters this model does not have: "
                             f"{unknown[:5]}. Resume with the model the checkpoint was written with.")
        for name, param in params.items():
            if name not in saved:
                optimizer.state.pop(param, None)


class Reference:
    """The reference policy in this layout: a frozen model of its own, the policy's reference adapter
    (`ref_adapter_name`), the policy with its adapter disabled (peft), or a shared base with every adapter disabled.
    `context(policy)` makes the policy act as the reference; `logprobs` is the reference pass."""

    def __init__(self, model: nn.Module | None, shared: SharedBaseModels | None, is_peft: bool,
                 ref_adapter_name: str | None, model_adapter_name: str | None, temperature: float):
        self.model, self.shared, self.is_peft = model, shared, is_peft
        self.adapter_name, self.policy_adapter_name = ref_adapter_name, model_adapter_name
        self.temperature = temperature

    @contextmanager
    def context(self, policy: nn.Module):
        """Inside: `policy` acts as the reference (its adapter disabled, or the reference adapter selected)."""
        if self.shared is not None:
            with self.shared.reference():
                yield
        elif self.adapter_name:
            policy.set_adapter(self.adapter_name)
            try:
                yield
            finally:
                policy.set_adapter(self.policy_adapter_name or "default")
        else:
            with policy.disable_adapter() if self.is_peft else nullcontext():
                yield

    def logprobs(self, policy: nn.Module, rows) -> torch.Tensor:
        """(B, T) fp32 reference log-probs of the response tokens of `rows` (`Padded` or `Packing`)."""
        if self.model is not None:
            return rows.model_logprobs(self.model, self.temperature)
        with self.context(policy):
            return rows.model_logprobs(policy, self.temperature)

    def generation_model(self, policy: nn.Module):
        """(model, context) that samples as the reference."""
        if self.model is not None:
            return self.model, nullcontext()
        return policy, self.context(policy)
