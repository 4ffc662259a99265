"""Memory planner for PPO with (Q)LoRA on one GPU: pure arithmetic, no torch.

    from trl_ext.tools.memory import ModelShape, PlanConfig, estimate_memory
    plan = PlanConfig.from_file("recipes/qlora_7b/shared_16gb.yaml")
    est = estimate_memory(ModelShape.from_preset("mistral-7b"), plan)
    print(est.format_table())            # or: trl-ext estimate-memory recipes/qlora_7b/shared_16gb.yaml

What is counted (bytes of live tensors, the quantity ``torch.cuda.max_memory_allocated`` reports):

- **static**: base weights (nf4 with double quant 0.516 B/param, no double quant 0.5625, int8 ~1, bf16 2, fp32 4 for the
  decoder's linear layers; embeddings, lm_head and norms stay in ``non_quantized_dtype``), LoRA adapters (trained ones
  with their fp32 gradients and optimizer states; frozen ones as weights only), value/reward heads, rollout buffers.
- **per phase** (each a transient on top of the static part): generation with a KV cache, the policy+value scoring
  forward, the reference forward, the reward forward, and the training step (micro-batch forward + backward) with or
  without gradient checkpointing; the peak is the largest phase.
- **headroom** for what ``max_memory_allocated`` does not see: ``cuda_overhead_gib`` (CUDA context, cuBLAS workspace;
  default 0.75 GiB) plus ``fragmentation`` (default 10%) of the peak for the caching allocator's reserved-but-unused
  memory. A GPU of C GiB "fits" when peak + headroom <= C.

Layouts: ``"shared"``: one base serves every role (policy, critic and frozen reward as LoRA adapters; reference = the
base with adapters disabled; a value head and a reward head on the hidden states). ``"separate"``: policy (LoRA;
reference = policy with its adapter disabled), critic (its own base, LoRA, value head) and reward model (its own base,
frozen) are three models.

How each activation term is derived (per token; h hidden, I intermediate, V vocab, S = prompt + response, a = bytes of
the compute dtype) is written next to it below. The saved-for-backward count of a decoder layer was read off PyTorch's
autograd graph (``torch.autograd.graph.saved_tensors_hooks``) for HF's Llama with peft LoRA (checked by
tests/tools/test_memory_planner.py for fp32, bf16, and bf16 under autocast). ``benchmarks/validate_memory_cpu.py``
compares every phase with the live tensor bytes of the real PPOTrainer on CPU (fp32 and bf16 autocast, both layouts,
nf4; the errors: docs/results.md); ``benchmarks/memory_7b_gpu.py`` does the same for a 7B-shaped 4-bit model on a GPU
(not yet run). What only a GPU shows (CUDA's 4-bit dequantization buffers, the headroom) is derived, not measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace

__all__ = ["GIB", "PRESETS", "ModelShape", "PlanConfig", "MemoryEstimate", "estimate_memory", "load_shape",
           "GPU_SIZES_GIB", "quantized_bytes_per_param", "presets_summary", "largest_response_length", "forward_pass"]

GIB = 1024**3
GPU_SIZES_GIB = (24, 16, 12)
FLOAT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
BASE_DTYPES = ("nf4", "fp4", "int8", "bf16", "fp16", "fp32")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# linear layers that read the same input tensor: saved once when LoRA does not cast its input
INPUT_GROUPS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_act"}
BNB_BLOCK = 64  # bitsandbytes 4-bit blocksize (absmax per 64 weights)
BNB_NESTED_BLOCK = 256  # double quant: the absmaxes quantized to 8 bit in blocks of 256, one fp32 scale each


def quantized_bytes_per_param(base_dtype: str, double_quant: bool = True) -> float:
    """Bytes per weight of a decoder linear layer stored as `base_dtype` (the per-row/per-block scales included).

    nf4/fp4: 4 bits + an absmax per 64 weights: fp32 (4/64 B) without double quant, 8-bit with one fp32 scale per
    256 absmaxes with it: 0.5 + 1/64 + 4/(64·256) = 0.51587. int8 (LLM.int8): 1 B, plus one fp32 scale per output row
    (counted in `ModelShape.linear_bytes`)."""
    if base_dtype in ("nf4", "fp4"):
        absmax = (1 + 4 / BNB_NESTED_BLOCK) if double_quant else 4
        return 0.5 + absmax / BNB_BLOCK
    if base_dtype == "int8":
        return 1.0
    if base_dtype in FLOAT_BYTES:
        return float(FLOAT_BYTES[base_dtype])
    raise ValueError(f"base_dtype={base_dtype!r} is not one of {BASE_DTYPES}")


# ---------------------------------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder (Llama, Mistral, Qwen2): what the planner needs of its config.json."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    """None: hidden_size // num_attention_heads"""
    attention_bias: bool = False
    """q/k/v biases (Qwen2); they stay unquantized"""

    def __post_init__(self):
        for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be a positive int (model {self.name!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) (model {self.name!r})")

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.dim_head

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.dim_head

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """Weights of all decoder linear layers (the quantized part), biases excluded."""
        return self.num_hidden_layers * sum(a * b for a, b in self.linear_dims().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def small_params(self) -> int:
        """Norms (2 per layer + the final one) and q/k/v biases."""
        bias = (self.q_dim + 2 * self.kv_dim) * self.num_hidden_layers if self.attention_bias else 0
        return (2 * self.num_hidden_layers + 1) * self.hidden_size + bias

    def num_parameters(self, lm_head: bool = True) -> int:
        """Total parameters of the causal LM (lm_head=True) or of the backbone alone."""
        head = self.embedding_params if lm_head and not self.tie_word_embeddings else 0
        return self.linear_params + self.embedding_params + self.small_params + head

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """Parameters of one LoRA adapter: r·(in + out) per targeted linear layer, in every decoder layer."""
        dims = self.linear_dims()
        return self.num_hidden_layers * sum(r * (dims[t][0] + dims[t][1]) for t in targets)

    @classmethod
    def from_config(cls, config: dict, name: str | None = None) -> ModelShape:
        """From a Hugging Face config.json dict (Llama, Mistral, Qwen2 and other Llama-like decoders)."""
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in config]
        if missing:
            raise ValueError(f"config {name or ''} lacks {missing}: the planner needs a Llama-like decoder config "
                             "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)")
        return cls(
            name=name or config.get("_name_or_path") or config.get("model_type", "model"),
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"], num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab_size=config["vocab_size"], tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=config.get("head_dim"),
            attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        )

    def to_config(self) -> dict:
        """The config.json fields of a Llama model of this shape (LlamaConfig(**shape.to_config()))."""
        return {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings, "head_dim": self.dim_head,
                "attention_bias": self.attention_bias}

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))} "
                             "(or pass the path of a config.json)")
        return PRESETS[key]


# the published config.json values (meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B, mistralai/Mistral-7B-v0.1,
# Qwen/Qwen2.5-7B)
PRESETS: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
    "llama-3-8b": ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
    "mistral-7b": ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 32000),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, attention_bias=True),
}


def load_shape(spec: str) -> ModelShape:
    """A preset name, or the path of a config.json (or of a folder holding one)."""
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing "
                         "config.json file or folder")
    with open(path) as fh:
        return ModelShape.from_config(json.load(fh), name=os.path.basename(os.path.dirname(os.path.abspath(path))))


# ---------------------------------------------------------------------------------------------------- the plan


@dataclass
class PlanConfig:
    """A recipe's memory-relevant settings. Batch and length fields carry PPOConfig's names, so a recipe script can
    pass them on; the rollout batch per device is per_device_train_batch_size · gradient_accumulation_steps
    (PPOConfig's local_batch_size; num_mini_batches splits it into minibatches)."""

    model: str | None = None
    """preset name or config.json path (the CLI's --model overrides it)"""
    layout: str = "shared"
    """"shared": one base for policy, reference, critic and reward; "separate": policy(+reference), critic, reward"""
    base_dtype: str = "nf4"
    """storage of the decoder's linear layers: nf4, fp4, int8, bf16, fp16, fp32"""
    bnb_4bit_use_double_quant: bool = True
    compute_dtype: str = "bf16"
    """dtype of activations (bnb_4bit_compute_dtype / torch_dtype): bf16, fp16, fp32"""
    non_quantized_dtype: str | None = None
    """embeddings, lm_head, norms of a quantized base; None = compute_dtype (fp32 after
    prepare_model_for_kbit_training)"""
    autocast: bool | None = None
    """mixed precision (PPOConfig bf16/fp16 → the Accelerator's autocast); None = compute_dtype is not fp32"""
    lora_r: int = 16
    lora_target_modules: str | list[str] = "all-linear"
    lora_dtype: str = "fp32"
    """peft keeps adapter weights in fp32 (autocast_adapter_dtype=True)"""
    optim: str = "adamw_torch"
    """adamw_torch (8 B/trained param), an 8-bit AdamW (anything with "8bit": 2 B), sgd (0 B)"""
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 8
    num_mini_batches: int = 1
    local_rollout_forward_batch_size: int = 8
    max_prompt_length: int = 256
    response_length: int = 256
    gradient_checkpointing: bool = True
    chunked_logits: bool = True
    """trl_ext's forwards: logits of the T + 1 positions that predict response tokens only (logits_to_keep) and
    log-probs C positions at a time (trl_ext.core.token_logprobs). False: TRL 1.12's way (logits of all positions,
    fp32 copies of the (B, T, V) response logits)"""
    logits_chunk_size: int = 64
    padding_free: bool = False
    """PPOConfig.padding_free: each scoring chunk and training micro-batch runs as one packed sequence of its real
    tokens (sdpa's (N, N) block mask over its N tokens; flash_attention_2 builds none, so this overestimates it)"""
    max_tokens_per_micro_batch: int | None = None
    """PPOConfig.max_tokens_per_micro_batch (needs padding_free): scoring chunks and micro-batches of at most this
    many real tokens; the estimate is for the worst packing (`forward_pass`)"""
    min_prompt_length: int = 1
    """the shortest prompt (tokens): a token budget's worst packing is of rows this short with full responses, the
    most response positions (logits) a budget can hold"""
    cuda_overhead_gib: float = 0.75
    fragmentation: float = 0.10
    notes: str = ""
    """free text (ignored by the planner)"""

    def __post_init__(self):
        if self.layout not in ("shared", "separate"):
            raise ValueError(f"layout={self.layout!r} must be 'shared' or 'separate'")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"base_dtype={self.base_dtype!r} must be one of {BASE_DTYPES}")
        for f in ("compute_dtype", "lora_dtype"):
            if getattr(self, f) not in FLOAT_BYTES:
                raise ValueError(f"{f}={getattr(self, f)!r} must be one of {tuple(FLOAT_BYTES)}")
        if self.non_quantized_dtype is not None and self.non_quantized_dtype not in FLOAT_BYTES:
            raise ValueError(f"non_quantized_dtype={self.non_quantized_dtype!r} must be one of {tuple(FLOAT_BYTES)} "
                             "or null")
        for f in ("lora_r", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                  "local_rollout_forward_batch_size", "max_prompt_length", "response_length", "logits_chunk_size",
                  "min_prompt_length"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be a positive int")
        if self.cuda_overhead_gib < 0 or not 0 <= self.fragmentation < 1:
            raise ValueError(f"cuda_overhead_gib={self.cuda_overhead_gib} must be >= 0 and fragmentation="
                             f"{self.fragmentation} in [0, 1)")
        budget = self.max_tokens_per_micro_batch
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ValueError(f"max_tokens_per_micro_batch={budget!r} must be a positive int or null")
            if not self.padding_free:
                raise ValueError(f"max_tokens_per_micro_batch={budget} needs padding_free: true (as in PPOConfig)")
            if budget < self.max_prompt_length + self.response_length:
                raise ValueError(f"max_tokens_per_micro_batch={budget} cannot hold the longest row: "
                                 f"max_prompt_length + response_length = "
                                 f"{self.max_prompt_length + self.response_length} (as PPOConfig refuses it)")
        if self.padding_free and not self.chunked_logits:
            raise ValueError("padding_free: true computes logits at the response positions only: it needs "
                             "chunked_logits: true (chunked_logits: false plans TRL 1.12's trainer, which has no "
                             "padding-free passes)")
        if self.min_prompt_length > self.max_prompt_length:
            raise ValueError(f"min_prompt_length={self.min_prompt_length} is above max_prompt_length="
                             f"{self.max_prompt_length}")
        _ = self.lora_targets  # validates the names
        _ = self.optimizer_bytes_per_param  # validates optim

    @property
    def lora_targets(self) -> tuple[str, ...]:
        t = self.lora_target_modules
        if t == "all-linear":
            return LINEAR_NAMES
        names = [t] if isinstance(t, str) else list(t)
        bad = [n for n in names if n not in LINEAR_NAMES]
        if bad or not names:
            raise ValueError(f"lora_target_modules={t!r}: unknown {bad or 'empty list'}; use 'all-linear' or a list "
                             f"of {LINEAR_NAMES}")
        return tuple(n for n in LINEAR_NAMES if n in names)

    @property
    def optimizer_bytes_per_param(self) -> int:
        o = self.optim.lower()
        if "8bit" in o:
            return 2
        if o.startswith("sgd"):
            return 0
        if "adam" in o or "lion" in o:
            return 4 if "lion" in o else 8
        raise ValueError(f"optim={self.optim!r}: the planner knows adamw_torch/adamw_* (8 B per trained param), "
                         "8-bit AdamW (*8bit*, 2 B), lion (4 B) and sgd (0 B)")

    @property
    def local_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def is_quantized(self) -> bool:
        return self.base_dtype in ("nf4", "fp4", "int8")

    @property
    def uses_autocast(self) -> bool:
        return self.compute_dtype != "fp32" if self.autocast is None else self.autocast

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> PlanConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str) -> PlanConfig:
        """A YAML (.yaml/.yml) or JSON (.json) file of PlanConfig fields."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"plan config {path!r} does not exist")
        with open(path) as fh:
            text = fh.read()
        if path.endswith(".json"):
            data = json.loads(text)
        elif path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"plan config {path!r}: use a .yaml, .yml or .json file")
        if not isinstance(data, dict):
            raise ValueError(f"plan config {path!r} must hold a mapping of fields, got {type(data).__name__}")
        return cls.from_dict(data, source=path)


# ---------------------------------------------------------------------------------------------------- the estimate


@dataclass
class Phase:
    name: str
    terms: dict[str, int]
    """activation terms (bytes) that are live together at this phase's peak"""
    extra_static: int = 0
    """static memory that exists only in this phase (the trained parameters' gradients)"""

    @property
    def activations(self) -> int:
        return sum(self.terms.values()) + self.extra_static


@dataclass
class MemoryEstimate:
    shape: ModelShape
    plan: PlanConfig
    static: dict[str, int]
    """component -> bytes, resident in every phase"""
    phases: list[Phase]
    alternative_training: Phase
    """the training step with gradient checkpointing the other way round (for the table)"""
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def static_bytes(self) -> int:
        return sum(self.static.values())

    def phase_total(self, phase: Phase) -> int:
        return self.static_bytes + phase.activations

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=self.phase_total)

    @property
    def peak_bytes(self) -> int:
        """Estimated torch.cuda.max_memory_allocated()."""
        return self.phase_total(self.peak_phase)

    @property
    def required_bytes(self) -> float:
        """Peak plus headroom (CUDA context, allocator fragmentation): what the GPU must have."""
        return self.peak_bytes * (1 + self.plan.fragmentation) + self.plan.cuda_overhead_gib * GIB

    def fits(self, gib: float) -> bool:
        return self.required_bytes <= gib * GIB

    def verdicts(self, sizes=GPU_SIZES_GIB) -> dict[str, str]:
        out = {}
        for g in sizes:
            margin = (g * GIB - self.required_bytes) / GIB
            out[f"{g} GB"] = (f"fits ({margin:.1f} GiB spare)" if margin >= 0
                              else f"does not fit ({-margin:.1f} GiB short)")
        return out

    def to_dict(self) -> dict:
        return {
            "model": asdict(self.shape),
            "plan": asdict(self.plan),
            "counts": self.counts,
            "static_bytes": self.static,
            "phases": {p.name: {"terms": p.terms, "extra_static": p.extra_static, "total": self.phase_total(p)}
                       for p in self.phases},
            "training_other_checkpointing": {"terms": self.alternative_training.terms,
                                             "total": self.phase_total(self.alternative_training)},
            "peak_phase": self.peak_phase.name,
            "peak_bytes": self.peak_bytes,
            "peak_gib": self.peak_bytes / GIB,
            "required_gib": self.required_bytes / GIB,
            "verdicts": self.verdicts(),
        }

    def format_table(self) -> str:
        p, s = self.plan, self.shape
        g = lambda b: f"{b / GIB:7.2f}"  # noqa: E731
        budget = p.max_tokens_per_micro_batch
        packed = "" if not p.padding_free else ", padding-free" + (
            f" with at most {budget} tokens a pass (its worst packing: prompts of {p.min_prompt_length})"
            if budget else "")
        lines = [
            f"model {s.name}: {s.num_parameters() / 1e9:.2f}B params (h={s.hidden_size}, I={s.intermediate_size}, "
            f"L={s.num_hidden_layers}, heads={s.num_attention_heads}/{s.num_key_value_heads} kv, V={s.vocab_size})",
            f"plan: layout={p.layout}, base={p.base_dtype}, compute={p.compute_dtype}, LoRA r={p.lora_r} on "
            f"{len(p.lora_targets)} linear kinds, rollout batch {p.local_batch_size} (forward chunks of "
            f"{p.local_rollout_forward_batch_size}), micro-batch {p.per_device_train_batch_size}, "
            f"prompt {p.max_prompt_length} + response {p.response_length} tokens, "
            f"checkpointing {'on' if p.gradient_checkpointing else 'off'}, "
            f"chunked logits {'on' if p.chunked_logits else 'off'}" + packed,
            "",
            f"{'component':<66}{'GiB':>8}",
            "static (every phase)",
        ]
        for name, b in self.static.items():
            lines.append(f"  {name:<64}{g(b)}")
        lines.append(f"  {'= static total':<64}{g(self.static_bytes)}")
        peak = self.peak_phase
        for ph in self.phases + [self.alternative_training]:
            mark = "   <- peak" if ph is peak else ""
            alt = " (not used)" if ph is self.alternative_training else ""
            lines.append(f"phase: {ph.name}{alt}")
            if ph.extra_static:
                lines.append(f"  {'gradients of the trained parameters':<64}{g(ph.extra_static)}")
            for name, b in ph.terms.items():
                lines.append(f"  {name:<64}{g(b)}")
            lines.append(f"  {'= static + phase':<64}{g(self.phase_total(ph))}{mark}")
        lines += [
            "",
            f"peak phase: {peak.name}",
            f"{'peak (estimated torch.cuda.max_memory_allocated)':<66}{g(self.peak_bytes)}",
            f"{f'+ headroom: {p.cuda_overhead_gib:g} GiB CUDA context + {p.fragmentation:.0%} fragmentation':<66}"
            f"{g(self.required_bytes - self.peak_bytes)}",
            f"{'= needed on the GPU':<66}{g(self.required_bytes)}",
        ]
        lines += [f"  {k}: {v}" for k, v in self.verdicts().items()]
        longest = {g: largest_response_length(s, p, g) for g in GPU_SIZES_GIB}
        lines.append("longest response that fits, the rest as planned: " + ", ".join(
            f"{g} GB: {t} tokens" if t else f"{g} GB: none" for g, t in longest.items()))
        return "\n".join(lines)


def largest_response_length(shape: ModelShape, plan: PlanConfig, gib: float) -> int:
    """The largest `response_length` (every other setting as in `plan`) whose estimate fits a `gib` GB GPU; 0 if not
    even 1 token does. A token budget caps it at max_tokens_per_micro_batch - max_prompt_length (the longest row)."""
    def fits(T: int) -> bool:
        return estimate_memory(shape, replace(plan, response_length=T)).fits(gib)

    budget = plan.max_tokens_per_micro_batch
    lo, hi = 0, (budget - plan.max_prompt_length) if budget else 1 << 20
    if hi >= 1 and fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) (or lo == 0), not fits(hi): memory grows with the response length
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def presets_summary(plan: PlanConfig, sizes=GPU_SIZES_GIB) -> str:
    """One line per preset model: estimated peak, what the GPU needs (peak + headroom), the peak phase, verdicts."""
    lines = [f"{'model':<12}{'peak GiB':>9}{'needed GiB':>11}  {'peak phase':<40}"
             + "".join(f"{f'{g} GB':>6}" for g in sizes)]
    for name, shape in PRESETS.items():
        e = estimate_memory(shape, plan)
        lines.append(f"{name:<12}{e.peak_bytes / GIB:>9.1f}{e.required_bytes / GIB:>11.1f}  {e.peak_phase.name:<40}"
                     + "".join(f"{'fits' if e.fits(g) else 'no':>6}" for g in sizes))
    return "\n".join(lines)


def _float(dtype: str) -> int:
    return FLOAT_BYTES[dtype]


def _base_weight_bytes(shape: ModelShape, plan: PlanConfig, lm_head: bool) -> tuple[int, int]:
    """(quantized linear weights, unquantized rest) of one base model. A base without lm_head (a sequence-classification
    critic or reward model) has a 1-output score head instead (counted with the heads)."""
    if plan.is_quantized:
        bpp = quantized_bytes_per_param(plan.base_dtype, plan.bnb_4bit_use_double_quant)
        linear = shape.linear_params * bpp
        if plan.base_dtype == "int8":  # one fp32 scale per output row
            linear += 4 * shape.num_hidden_layers * sum(o for _, o in shape.linear_dims().values())
        rest_bytes = _float(plan.non_quantized_dtype or plan.compute_dtype)
    else:
        linear = shape.linear_params * _float(plan.base_dtype)
        rest_bytes = _float(plan.base_dtype)
    rest = shape.num_parameters(lm_head=lm_head) - shape.linear_params
    return int(linear), rest * rest_bytes


def _layer_saved_per_token(shape: ModelShape, plan: PlanConfig, a: int, seq: int) -> dict[str, float]:
    """Bytes one decoder layer saves for backward per token (frozen base, LoRA on `plan.lora_targets`, padding mask).

    Read off the autograd graph of HF's LlamaDecoderLayer with peft LoRA (sdpa attention):
      - each RMSNorm saves an fp32 copy of its input (2 per layer);
      - each LoRA'd linear saves its input for lora_A's weight gradient. One tensor per input group (q/k/v share the
        normed input, gate/up share theirs) when the input reaches lora_A uncast: fp32 LoRA on an fp32 model, or a
        bnb 4-bit base under autocast (peft's bnb layer skips the cast). Otherwise one copy per targeted layer: peft
        casts x to the adapter's fp32 (bytes 4), and autocast casts that back to bf16 for the matmul (bytes a);
      - sdpa saves q, k, v (k and v repeated to all heads: HF calls repeat_kv when a mask is given), its output, the
        logsumexp (fp32 per head) and the mask converted to the query dtype (S per token);
      - the MLP saves gate_proj's output (SiLU), SiLU's output and up_proj's output (their product);
      - lora_B saves lora_A's output (r per targeted layer).
    """
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    targets = plan.lora_targets
    dims = shape.linear_dims()
    lora_b = _float(plan.lora_dtype)
    shared_input = lora_b == a or (plan.uses_autocast and plan.is_quantized)
    if shared_input:
        groups = {INPUT_GROUPS[t]: dims[t][0] for t in targets}
        lora_in = sum(groups.values()) * a
        # o_proj's uncast input is the attention output sdpa saves anyway
        attn_out_shared = "attn_out" in groups
    else:
        per = a if plan.uses_autocast else lora_b
        lora_in = sum(dims[t][0] for t in targets) * per
        attn_out_shared = False
    return {
        "norms": 2 * h * 4 + 2 * 4,
        "lora_inputs": lora_in,
        "attention": (3 * q + (0 if attn_out_shared else q)) * a + shape.num_attention_heads * 4 + seq * a,
        "mlp": 3 * i * a,
        "lora_hidden": len(targets) * plan.lora_r * (a if plan.uses_autocast else lora_b),
    }


def _layer_transient_per_token(shape: ModelShape, plan: PlanConfig, a: int, s: int) -> int:
    """Peak working set of one decoder layer's forward without grad, per token: the residual stream in and out and
    the normed input (h each), the LoRA input cast (fp32 h when the adapter dtype differs), and three MLP tensors of
    size I (gate→SiLU, up, their product)."""
    h, i = shape.hidden_size, shape.intermediate_size
    cast = h * _float(plan.lora_dtype) if _float(plan.lora_dtype) != a and not plan.is_quantized else 0
    return 2 * h * s + h * a + cast + 3 * i * a


_TRAINED_ADAPTERS = 2  # policy and critic


@dataclass
class _Sizes:
    """What every part of the estimate reads: the byte widths and the sizes of one run."""
    a: int  # activation bytes: the compute dtype (autocast) or the model's own
    s: int  # bytes of the unquantized weights (embeddings, norms, heads)
    a_logits: int  # bytes of the lm_head's output
    f: int  # sequences per scoring forward (local_rollout_forward_batch_size, at most the batch)
    n_lora: int  # parameters of one LoRA adapter
    dequant: int  # bytes of the largest dequantized weight (4-bit/8-bit bases; else 0)
    head_cast: int  # autocast's copy of the lm_head in the compute dtype, when it is stored wider (else 0)
    chunk: int  # positions per log-prob chunk: min(logits_chunk_size, response_length)


def _sizes(shape: ModelShape, plan: PlanConfig) -> _Sizes:
    a = _float(plan.compute_dtype)
    s = _float(plan.non_quantized_dtype or plan.compute_dtype) if plan.is_quantized else _float(plan.base_dtype)
    if not plan.is_quantized and not plan.uses_autocast:
        a = s  # an unquantized model computes in its own dtype
    a_logits = a if plan.uses_autocast else s  # lm_head output: the compute dtype (autocast) or the lm_head's dtype
    dequant = 0
    if plan.is_quantized:  # bnb dequantizes the largest weight to the compute dtype for a multi-token matmul
        dequant = max(i * o for i, o in shape.linear_dims().values()) * a
    # autocast casts an fp32 lm_head to the compute dtype for its matmul: alive beside the KV cache in generation,
    # beside the logits it makes in scoring, and saved for backward in training
    head_cast = shape.vocab_size * shape.hidden_size * a if plan.uses_autocast and s > a else 0
    return _Sizes(a=a, s=s, a_logits=a_logits, f=min(plan.local_rollout_forward_batch_size, plan.local_batch_size),
                  n_lora=shape.lora_params(plan.lora_r, plan.lora_targets), dequant=dequant, head_cast=head_cast,
                  chunk=min(plan.logits_chunk_size, plan.response_length))


def _static_memory(shape: ModelShape, plan: PlanConfig, z: _Sizes) -> dict[str, int]:
    """What stays for the whole run: the bases, the trained LoRA and heads with their optimizer states, the
    rollout buffers."""
    static: dict[str, int] = {}
    shared = plan.layout == "shared"
    bases = [("policy", True)] if shared else [("policy+reference", True), ("critic", False), ("reward", False)]
    double = plan.base_dtype in ("nf4", "fp4") and plan.bnb_4bit_use_double_quant
    qname = f"{plan.base_dtype}{' double-quant' if double else ''}" if plan.is_quantized else plan.base_dtype
    nq_dtype = (plan.non_quantized_dtype or plan.compute_dtype) if plan.is_quantized else plan.base_dtype
    for role, lm_head in bases:
        lin, rest = _base_weight_bytes(shape, plan, lm_head)
        label = "shared base" if shared else f"{role} base"
        static[f"{label}: decoder linears ({shape.linear_params / 1e9:.2f}B params, {qname})"] = lin
        what = "embeddings, lm_head, norms" if lm_head and not shape.tie_word_embeddings else "embeddings, norms"
        static[f"{label}: {what} ({nq_dtype})"] = rest
    opt, trained, head_params = plan.optimizer_bytes_per_param, _TRAINED_ADAPTERS * z.n_lora, shape.hidden_size
    static[f"LoRA policy+critic: {trained / 1e6:.1f}M params ({plan.lora_dtype}) + optimizer states"] = (
        trained * (_float(plan.lora_dtype) + opt))
    static["value head (trained) + reward head"] = head_params * (4 + opt) + head_params * 4
    if shared:
        static[f"LoRA reward adapter (frozen): {z.n_lora / 1e6:.1f}M params"] = z.n_lora * _float(plan.lora_dtype)
    # rollout buffers: ids and masks (B, P)+(B, R) int64/bool, and ~10 (B, R) fp32 tensors (logprobs, ref_logprobs,
    # values, scores, kl, rewards, advantages, returns, ...)
    B, S, R = plan.local_batch_size, plan.max_prompt_length + plan.response_length, plan.response_length
    static["rollout buffers"] = B * S * 9 + B * R * 4 * 10
    return static


@dataclass(frozen=True)
class Pass:
    """The sizes of one forward: the `tokens` it runs, the `logit_positions` whose logits it computes, and `mask`, the
    positions each token's row of the attention mask spans (padded: the row length S; packed: all N tokens)."""
    tokens: int
    logit_positions: int
    mask: int
    label: str


def forward_pass(plan: PlanConfig, rows: int) -> Pass:
    """One scoring chunk or training micro-batch of up to `rows` rows. Padded: `rows` rows of S = prompt + response
    tokens, logits of the T + 1 positions that predict response tokens (all S without chunked logits). Padding-free
    (`plan.padding_free`): one packed sequence; with a token budget, the worst packing: as many tokens as the budget
    allows (N), and as many of them response tokens as rows of `min_prompt_length` + T tokens can make (R); without
    one, the `rows` rows at full length."""
    P, T = plan.max_prompt_length, plan.response_length
    S = P + T
    if not plan.padding_free:
        return Pass(rows * S, rows * (T + 1 if plan.chunked_logits else S), S, f"{rows}×{S} tokens")
    N = rows * S if plan.max_tokens_per_micro_batch is None else min(plan.max_tokens_per_micro_batch, rows * S)
    full_rows, rest = divmod(N, plan.min_prompt_length + T)
    R = min(rows * T, full_rows * T + max(0, rest - plan.min_prompt_length))
    return Pass(N, R, N, f"{N} packed tokens")


def _rollout_phases(shape: ModelShape, plan: PlanConfig, z: _Sizes) -> list[Phase]:
    """1. generation, 2.-4. the scoring forwards (no grad, chunks of f sequences of S tokens, or packed chunks)."""
    V, L, P, R = shape.vocab_size, shape.num_hidden_layers, plan.max_prompt_length, plan.response_length
    S, f, a_logits = P + R, z.f, z.a_logits
    layer_t = _layer_transient_per_token(shape, plan, z.a, z.s)
    dq = {"dequantized weight (one linear, compute dtype)": z.dequant} if z.dequant else {}
    # 1. generation (padded, whatever padding_free says): the KV cache for S tokens of f sequences, plus the
    # prefill's per-layer working set with its (f, 1, S, S) bool mask and that mask's per-layer conversion
    kv = 2 * L * f * S * shape.kv_dim * z.a
    cast = {"lm_head cast to the compute dtype (autocast)": z.head_cast} if z.head_cast else {}
    gen = {f"KV cache: 2·L·{f} seqs·{S} tokens·{shape.kv_dim} kv dim": kv,
           f"prefill working set of one layer ({f}×{P} tokens)": f * P * (layer_t + S * (1 + z.a)),
           f"sampling: last-position logits, fp32 ({f}×V ×3)": f * V * 4 * 3, **dq, **cast}
    # 2.-4. chunked (trl_ext): logits of the positions that predict response tokens only (logits_to_keep),
    # log-probs C positions at a time (core.token_logprobs); not chunked (TRL 1.12): logits of all S positions, then
    # logits[:, Q-1:-1].float() / T: an fp32 copy (when the logits are not fp32) and its quotient
    C = z.chunk
    chunk = forward_pass(plan, plan.local_batch_size if plan.max_tokens_per_micro_batch else f)
    lname = "bf16" if a_logits == 2 else "fp32"
    full = chunk.logit_positions * V * a_logits
    if plan.chunked_logits:
        # per (C, V) chunk: the fp32 upcast (none for fp32 logits), its quotient by T, logsumexp's working tensor
        n = 2 if a_logits == 4 else 3
        logp = {f"log-probs, {C} positions at a time (fp32 ×{n})": n * C * V * 4}
    else:
        logp = {f"response logits / T, fp32 ({f}×{R}×V{' ×2' if a_logits != 4 else ''})":
                f * R * V * 4 * (2 if a_logits != 4 else 1),
                "logsumexp working set (one row, fp32)": R * V * 4}
    fwd_t = chunk.tokens * (layer_t + chunk.mask * (1 + z.a))  # one layer, its mask and the mask's conversion
    logits = f"({chunk.label}: {chunk.logit_positions} positions ×V, {lname})"
    # the policy's logits stay alive while the value model runs, then the log-probs are taken
    # (autocast's lm_head cast is freed once the logits are made, before the log-probs)
    policy_value = {f"policy logits {logits}": full,
                    "the larger of: value forward (one layer), log-probs, lm_head cast":
                    max(fwd_t, sum(logp.values()), z.head_cast), **dq}
    ref = {f"reference logits {logits}": full,
           "the larger of: log-probs, lm_head cast": max(sum(logp.values()), z.head_cast), **dq}
    if not plan.chunked_logits:  # the quotient is made while the full logits exist, then upcast
        ref[f"response logits / T ({f}×{R}×V, {lname})"] = f * R * V * a_logits if a_logits != 4 else 0
    reward = {f"one layer ({chunk.label})": fwd_t, "final hidden states": chunk.tokens * shape.hidden_size * z.s,
              **dq}
    return [Phase("generation (KV cache)", gen), Phase("scoring: policy + value forward", policy_value),
            Phase("scoring: reference forward", ref), Phase("scoring: reward forward", reward)]


def _training_phase(shape: ModelShape, plan: PlanConfig, z: _Sizes, checkpointing: bool) -> Phase:
    """5. training step: a micro-batch of m sequences through policy and critic, the losses, backward.
    separate: one forward of both models, one backward of the summed loss (both models' activations live);
    shared: the policy pass (forward + backward) and then the critic pass, each with its own adapter (trl_ext's
    `PPOUpdate._shared_losses`), so one role's activations at a time; the policy pass is the larger one."""
    h, V, L, R = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers, plan.response_length
    m, a, s, a_logits = plan.per_device_train_batch_size, z.a, z.s, z.a_logits
    shared = plan.layout == "shared"
    n_models, who = (1, "policy pass") if shared else (2, "policy + critic")
    C = z.chunk
    # a token budget packs up to a minibatch's rows into one micro-batch
    micro = forward_pass(plan, plan.local_batch_size // plan.num_mini_batches if plan.max_tokens_per_micro_batch
                         else m)
    per_layer_sum = sum(_layer_saved_per_token(shape, plan, a, micro.mask).values())
    tokens = micro.tokens
    terms: dict[str, int] = {}
    # backward runs from the loss down: first through the logits (every layer's saved tensors, or checkpointed
    # inputs, still alive), then layer by layer; the logits and their gradients are gone before the layers'
    # backward begins, so the phase's peak is the larger of the two stages
    backward = tokens * (2 * h * s + 2 * shape.intermediate_size * a)  # residual-stream and MLP gradients
    if checkpointing:
        # each checkpointed layer keeps its input; backward recomputes one layer at a time
        terms[f"checkpointed layer inputs ({who}: {n_models}×L × {micro.label} × h)"] = n_models * L * tokens * h * s
        layer_stage = int(tokens * per_layer_sum) + backward
    else:
        terms[f"saved activations ({who}: {n_models}×L × {micro.label} × {per_layer_sum / 1024:.1f} KiB)"] = int(
            n_models * L * tokens * per_layer_sum)
        layer_stage = backward
    if not shared:
        terms["value head input (final hidden states)"] = tokens * h * s
    keep = micro.logit_positions * V * a_logits
    if plan.chunked_logits:
        # token_logprobs keeps the (m, T+1, V) logits for backward; its backward makes a (m, T, V) gradient,
        # and the slice's backward a (m, T+1, V) one; one (C, V) chunk at a time in fp32: the upcast logits / T,
        # the softmax, its product with the incoming gradient, that over T (4 tensors). Autocast's lm_head cast is
        # saved for the lm_head's backward, which runs after this stage
        logits_stage = 2 * keep + 4 * C * V * 4 + z.head_cast
    else:
        # TRL 1.12's way: x = the fp32 (m, T, V) response logits / T, kept (logsumexp saves them). Forward: the
        # (m, S, V) logits, the .float() copy and x coexist; backward: x, its gradient and the gradient through
        # the division (3x), then x, the gradient in the logits' dtype and the (m, S, V) gradient of the slice
        x = m * R * V * 4
        logits_stage = max(keep + x * (2 if a_logits != 4 else 1), 3 * x, x + x * a_logits // 4 + keep)
    larger = "logits" if logits_stage >= layer_stage else "layer"
    name = f"backward peak: the {larger} stage (logits {logits_stage / GIB:.2f}, layer {layer_stage / GIB:.2f} GiB)"
    terms[name] = max(logits_stage, layer_stage)
    if z.dequant:
        terms["dequantized weight (one linear, compute dtype)"] = z.dequant
    grads = _TRAINED_ADAPTERS * z.n_lora * _float(plan.lora_dtype) + h * 4  # the LoRA's and the value head's
    return Phase(f"training step ({'with' if checkpointing else 'without'} checkpointing)", terms,
                 extra_static=grads)


def estimate_memory(shape: ModelShape, plan: PlanConfig) -> MemoryEstimate:
    """The per-component, per-phase memory table of a PPO run with `plan` on a model of `shape` (see the module
    docstring for what is counted)."""
    z = _sizes(shape, plan)
    static = _static_memory(shape, plan, z)
    phases = _rollout_phases(shape, plan, z) + [_training_phase(shape, plan, z, plan.gradient_checkpointing)]
    alternative = _training_phase(shape, plan, z, not plan.gradient_checkpointing)
    counts = {"parameters": shape.num_parameters(), "lora_params_per_adapter": z.n_lora,
              "trained_params": _TRAINED_ADAPTERS * z.n_lora + shape.hidden_size,
              "rollout_batch": plan.local_batch_size}
    return MemoryEstimate(shape, plan, static, phases, alternative, counts)
