"""LoRA and QLoRA: low-rank adapters trained over a frozen base, merged or folded for deployment.

Three bases, one step (``"lora"``):

* **float** (``qlora=False``): peft's LoRA layers are injected in place
  (``peft.inject_adapter_in_model``) into ``nn.Linear`` / ``nn.Conv2d`` modules (CNNs) or
  the q/k/v/o/gate/up/down projections (transformers). ``merge=True`` (the default) folds
  ``W + (alpha/r) B A`` into the float weights and removes the adapters, so the model has
  the base's structure again and the next step of the chain (``int4`` GPTQ/AWQ/RTN or
  ``int8``) re-quantizes it.
* **packed** (``qlora=True, qlora_base="packed"``, the default QLoRA): edgekit's own 4-bit
  model (``QuantLinear`` from ``compress/packing.py``, made by ``edgekit compress --bits 4``).
  peft does not know that layer, so each targeted ``QuantLinear`` is wrapped by
  :class:`LoraQuantLinear` (``y = base(x) + dropout(x) A^T B^T * alpha/r``). While training,
  the frozen product ``x W^T`` goes through :class:`_FrozenDequantMatmul`, which dequantizes
  the packed weight in forward and again in backward instead of saving it, so the float
  weights never stay resident: this is what makes QLoRA's peak memory lower than LoRA's.
  Deployment: ``merge=False`` (the default here) *folds* the adapters into the exported
  graph: ``MatMulNBits`` (the int4 step's rewrite of the packed base) plus two small MatMuls
  per layer; exact, nothing re-rounded. ``merge=True`` adds ``B A`` to the dequantized weight
  and re-rounds it onto the layer's own 4-bit grid (same scales and zero points): smaller
  graph, but updates below half a quantization step are lost.
* **nf4** (``qlora=True, qlora_base="nf4"``): bitsandbytes NF4 (``Linear4bit``, CPU works)
  as the QLoRA paper does it, from a float model, through peft's bitsandbytes layers. It
  always ends merged into float weights (dequantized NF4 + B A), to be re-quantized by the
  next step if wanted. bitsandbytes repacks CPU weights for its fast inference kernel after
  a no-grad forward in eval mode, which breaks training and dequantization; edgekit turns
  that repacking off on the layers it makes.

The training loop (seeds, progress bar, checkpoints and resume, validation loss) is
``_train`` below; the user-facing API is ``edgekit.finetune.finetune``.
"""
from __future__ import annotations

import contextlib
import io
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.compress import Step, StepContext, config_to_dict
from edgekit.errors import BadInputError, UnavailableError, bad_choice
from edgekit.schema import check_fields
from edgekit.sources.data import resolve_samples
from edgekit.sources.handle import ModelHandle, StepRecord

# Default targets for transformer models (Llama/SmolLM2 names); CNNs and other models take
# every nn.Linear and (non-depthwise) nn.Conv2d instead.
TRANSFORMER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QLORA_BASES = ("packed", "nf4")
CHECKPOINT = "lora.ckpt.pt"


@dataclass(frozen=True)
class LoraConfig:
    """LoRA / QLoRA fine-tuning options (validated on construction).

    r, alpha, dropout: adapter rank, scale numerator (scale = alpha / r) and input dropout.
    targets: module names to adapt: a full name, a name suffix (``q_proj`` matches every
        ``...q_proj``) or a regular expression; empty = the defaults for the model kind.
    qlora: train over a frozen 4-bit base; qlora_base: "packed" (edgekit's int4 model) or
        "nf4" (bitsandbytes, from a float model).
    steps / epochs: training length (steps wins; neither = 1 epoch). lr, batch_size,
        weight_decay, grad_clip, warmup_steps: AdamW with linear warm-up then cosine decay.
    seqlen, train_samples, eval_samples: text window length and how many windows to use
        (None = all); eval_samples also bounds the validation split.
    merge: fold the adapters into the weights (None = the base's default: float and nf4
        merge, packed keeps them beside the 4-bit weights; see the module docstring).
    checkpoint_every: steps between checkpoints in the step's work folder (0 = never).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ()
    qlora: bool = False
    qlora_base: str = "packed"
    steps: int | None = None
    epochs: int | None = None
    lr: float = 2e-4
    batch_size: int = 4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    seqlen: int = 256
    train_samples: int | None = None
    eval_samples: int | None = 32
    merge: bool | None = None
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t for t in re.split(r"[,\s]+", self.targets) if t))
        else:
            object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise BadInputError(f"LoRA rank must be a positive integer, got {self.r!r} (e.g. --lora-r 8)")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise BadInputError(f"LoRA alpha must be positive, got {self.alpha!r} (e.g. --lora-alpha 16)")
        if not 0.0 <= self.dropout < 1.0:
            raise BadInputError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.qlora_base not in QLORA_BASES:
            raise bad_choice("QLoRA base", self.qlora_base, QLORA_BASES)
        for name in ("steps", "epochs", "train_samples", "eval_samples"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise BadInputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.steps is not None and self.epochs is not None:
            raise BadInputError(f"give --steps ({self.steps}) or --epochs ({self.epochs}), not both")
        if not self.lr > 0:
            raise BadInputError(f"learning rate must be positive, got {self.lr!r} (e.g. --lr 2e-4)")
        for name in ("batch_size", "seqlen"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise BadInputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise BadInputError("weight_decay, grad_clip, warmup_steps and checkpoint_every must be >= 0")
        if self.qlora and self.qlora_base == "nf4" and self.merge is False:
            raise BadInputError("--qlora-base nf4 always merges into float weights (bitsandbytes layers do not "
                                "save or export); use --merge, or --qlora-base packed to keep a 4-bit base")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.r


# ----------------------------------------------------------------------------------------
# The adapter layer over a packed 4-bit linear


def _torch() -> Any:
    import torch

    return torch


def _is_quant_linear(module: Any) -> bool:
    """edgekit's packed linear (or a subclass): duck-typed on ``dequantize`` and the sizes,
    so it works before and after ``compress/packing.py`` is importable."""
    import torch

    if isinstance(module, (torch.nn.Linear, LoraQuantLinear)):
        return False
    try:
        from edgekit.compress.packing import QuantLinear

        if isinstance(module, QuantLinear):
            return True
    except ImportError:
        pass
    return (callable(getattr(module, "dequantize", None)) and hasattr(module, "in_features")
            and hasattr(module, "out_features") and type(module).__name__.endswith("QuantLinear"))


def _is_bnb4(module: Any) -> bool:
    """A bitsandbytes 4-bit linear (checked without importing bitsandbytes, which is slow)."""
    cls = type(module)
    return (cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")
            and hasattr(getattr(module, "weight", None), "quant_state"))


# Packed layers larger than this many weights (an LM head: 49152 x 576) are dequantized in
# row chunks of this size, so no full float copy of them ever exists at once.
_CHUNK_ROWS = 4096
_CHUNK_ABOVE = 4_000_000


def _row_chunks(base: Any) -> list[tuple[int, int]]:
    rows = int(base.out_features)
    if rows * int(base.in_features) <= _CHUNK_ABOVE or not callable(getattr(base, "_dequant_rows", None)):
        return [(0, rows)]
    return [(i, min(rows, i + _CHUNK_ROWS)) for i in range(0, rows, _CHUNK_ROWS)]


def _dequant(base: Any, lo: int, hi: int, dtype: Any) -> Any:
    """Rows lo:hi of the float weight (out, in) of a packed layer."""
    if lo == 0 and hi == int(base.out_features):
        return base.dequantize().to(dtype)
    return base._dequant_rows(base.qweight[lo:hi], base.scales[lo:hi], base.qzeros[lo:hi]).to(dtype)


def _make_autograd_fn() -> Any:
    torch = _torch()

    class _FrozenDequantMatmul(torch.autograd.Function):
        """``x @ W^T`` for a frozen packed weight, without keeping ``W`` for backward.

        Autograd would save the dequantized float weight of every layer until backward
        (the whole float model again); this dequantizes it a second time in backward,
        in row chunks for large layers (the LM head), so QLoRA's memory stays that of the
        packed weights plus the activations.
        """

        @staticmethod
        def forward(ctx: Any, x: Any, base: Any) -> Any:  # type: ignore[override]
            ctx.base = base
            chunks = _row_chunks(base)
            if len(chunks) == 1:
                return x @ _dequant(base, 0, int(base.out_features), x.dtype).t()
            return torch.cat([x @ _dequant(base, lo, hi, x.dtype).t() for lo, hi in chunks], dim=-1)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            base = ctx.base
            out = None
            for lo, hi in _row_chunks(base):
                part = grad[..., lo:hi] @ _dequant(base, lo, hi, grad.dtype)
                out = part if out is None else out.add_(part)
            return out, None

    return _FrozenDequantMatmul


_FN: Any = None


def _frozen_dequant_matmul(x: Any, base: Any) -> Any:
    global _FN
    if _FN is None:
        _FN = _make_autograd_fn()
    return _FN.apply(x, base)


def _frozen_linear_forward(base: Any, x: Any) -> Any:
    """A packed layer's forward through ``_FrozenDequantMatmul`` (training only)."""
    y = _frozen_dequant_matmul(x, base)
    bias = getattr(base, "bias", None)
    return y if bias is None else y + bias.to(y.dtype)


@contextlib.contextmanager
def frozen_packed_forwards(module: Any) -> Any:
    """While training, route every packed layer that has no adapter (the LM head, layers
    not targeted) through the memory-saving matmul too; restore their forward afterwards."""
    import types

    patched = []
    for m in module.modules():
        if _is_quant_linear(m) and "forward" not in m.__dict__:
            m.forward = types.MethodType(lambda self, x: (_frozen_linear_forward(self, x) if self.training
                                                          and _torch().is_grad_enabled() else
                                                          type(self).forward(self, x)), m)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def _module_base() -> type:
    return _torch().nn.Module


class LoraQuantLinear(_module_base()):  # type: ignore[misc]
    """LoRA over a frozen packed 4-bit linear: ``y = base(x) + dropout(x) A^T B^T * alpha / r``.

    State dict keys: ``base_layer.*`` (the packed layer's own), ``lora_A.weight`` (r, in),
    ``lora_B.weight`` (out, r): the names peft uses, less its adapter name.
    """

    def __init__(self, base: Any, r: int, alpha: float, dropout: float = 0.0) -> None:
        torch = _torch()
        super().__init__()
        self.base_layer = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.r = r
        self.scaling = float(alpha) / r
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.lora_A = torch.nn.Linear(self.in_features, r, bias=False)
        self.lora_B = torch.nn.Linear(r, self.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as peft
        torch.nn.init.zeros_(self.lora_B.weight)
        for p in self.base_layer.parameters():
            p.requires_grad_(False)

    def forward(self, x: Any) -> Any:
        torch = _torch()
        if self.training and torch.is_grad_enabled():
            y = _frozen_linear_forward(self.base_layer, x)
        else:  # inference and export: the packed layer's own forward (-> MatMulNBits on export)
            y = self.base_layer(x)
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> Any:
        """(out, in) float update ``B A * alpha / r``."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, scaling={self.scaling}"


# ----------------------------------------------------------------------------------------
# Finding target modules


def _base_kind(module: Any) -> str:
    """What the model's linear layers are: "packed", "nf4" or "float"."""
    for m in module.modules():
        if _is_quant_linear(m) or isinstance(m, LoraQuantLinear):
            return "packed"
        if _is_bnb4(m):
            return "nf4"
    return "float"


def _adaptable(m: Any, base: str) -> bool:
    torch = _torch()
    if base == "packed":
        return _is_quant_linear(m)
    if base == "nf4":
        return _is_bnb4(m) or isinstance(m, torch.nn.Linear)
    if isinstance(m, torch.nn.Conv2d):
        return m.groups == 1  # peft's LoRA does not split grouped/depthwise convolutions
    return isinstance(m, torch.nn.Linear)


def _is_head(name: str, handle: ModelHandle) -> bool:
    return handle.kind == "causal-lm" and name.split(".")[-1] in ("lm_head", "embed_out", "output")


def candidate_modules(handle: ModelHandle, base: str | None = None) -> list[str]:
    """Names of the modules LoRA can adapt in this model (for messages and defaults)."""
    base = base or _base_kind(handle.module)
    return [n for n, m in handle.module.named_modules() if n and _adaptable(m, base)]


def _short_names(names: list[str]) -> list[str]:
    """Distinct last name components, in order (``q_proj``, ``k_proj``, ``0``...)."""
    seen: dict[str, None] = {}
    for n in names:
        seen.setdefault(n.split(".")[-1], None)
    return list(seen)


def resolve_targets(handle: ModelHandle, targets: Iterable[str], base: str) -> list[str]:
    """Full module names to adapt. Each target is a full name, a suffix or a regex.

    Raises BadInputError when a target matches nothing adaptable, naming the candidates.
    """
    cands = candidate_modules(handle, base)
    if not cands:
        kinds = {"packed": "packed 4-bit linear (QuantLinear)", "nf4": "linear",
                 "float": "nn.Linear or nn.Conv2d"}[base]
        raise BadInputError(f"model {handle.name!r} has no {kinds} layers for LoRA to adapt")
    targets = list(targets)
    if not targets:
        if handle.kind == "causal-lm" or any(n.split(".")[-1] in TRANSFORMER_TARGETS for n in cands):
            chosen = [n for n in cands if n.split(".")[-1] in TRANSFORMER_TARGETS]
            if chosen:
                return chosen
        return [n for n in cands if not _is_head(n, handle)]
    chosen: dict[str, None] = {}
    all_names = [n for n, _ in handle.module.named_modules() if n]
    for t in targets:
        hits = [n for n in cands if _matches(n, t)]
        if not hits:
            other = [n for n in all_names if _matches(n, t)]
            why = (f" (it names {type(handle.module.get_submodule(other[0])).__name__}, not an adaptable layer)"
                   if other else "")
            shown = _short_names(cands)
            raise BadInputError(
                f"LoRA target {t!r} matches no adaptable module{why}; candidates: "
                f"{', '.join(shown[:20])}{' ...' if len(shown) > 20 else ''}")
        for n in hits:
            chosen.setdefault(n, None)
    return list(chosen)


def _matches(name: str, target: str) -> bool:
    if name == target or name.endswith("." + target):
        return True
    try:  # a regex: the whole name, or its trailing dotted components
        return re.fullmatch(target, name) is not None or re.search(rf"(?:^|\.)(?:{target})$", name) is not None
    except re.error:
        return False


# ----------------------------------------------------------------------------------------
# Injecting, merging and listing adapters


def inject(handle: ModelHandle, config: LoraConfig, names: list[str], base: str) -> None:
    """Add adapters to ``names`` in place; freeze everything else."""
    module = handle.module
    for p in module.parameters():
        p.requires_grad_(False)
    if base == "packed":
        for n in names:
            module.set_submodule(n, LoraQuantLinear(module.get_submodule(n), config.r, config.alpha, config.dropout))
    else:
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model

        pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
        peft_config = PeftLoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                     target_modules=pattern, bias="none")
        try:
            inject_adapter_in_model(peft_config, module)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise BadInputError(f"peft cannot adapt the chosen modules of {handle.name!r}: "
                                f"{str(e).splitlines()[0]}") from None
    for n, p in module.named_parameters():
        p.requires_grad_("lora_A" in n or "lora_B" in n)
    if not any(p.requires_grad for p in module.parameters()):  # pragma: no cover - guarded above
        raise BadInputError(f"no LoRA parameters were created in {handle.name!r}")


def adapter_state(module: Any) -> dict[str, Any]:
    """The adapter tensors (``lora_A`` / ``lora_B``) by state-dict name, detached copies."""
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()
            if ".lora_A." in k or ".lora_B." in k}


def _lora_layers(module: Any) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in module.named_modules() if isinstance(m, (LoraLayer, LoraQuantLinear))]


def merge_adapters(handle: ModelHandle) -> dict[str, Any]:
    """Fold every adapter into its base weight and remove the adapter layers.

    float (peft): ``W += B A * s``; nf4: dequantize, add, back to a float ``nn.Linear``;
    packed: dequantize, add, re-round onto the layer's own grid (``_repack``).
    Returns statistics (layers, mean relative size of the update, share of it lost by
    re-rounding for packed layers).
    """
    torch = _torch()
    module = handle.module
    stats: dict[str, Any] = {"layers": 0}
    lost: list[float] = []
    rel: list[float] = []
    with torch.no_grad():
        for name, layer in _lora_layers(module):
            if isinstance(layer, LoraQuantLinear):
                base = layer.base_layer
                w = base.dequantize().float()
                delta = layer.delta_weight().float()
                _repack(base, w + delta)
                got = base.dequantize().float() - w
                lost.append(float((got - delta).norm() / delta.norm().clamp(min=1e-12)))
                rel.append(float(delta.norm() / w.norm().clamp(min=1e-12)))
                module.set_submodule(name, base)
            elif _is_bnb4(layer.get_base_layer()):
                import bitsandbytes.functional as bnbf

                b4 = layer.get_base_layer()
                w = bnbf.dequantize_4bit(b4.weight.data, b4.weight.quant_state).float()
                delta = layer.get_delta_weight("default").float()
                rel.append(float(delta.norm() / w.norm().clamp(min=1e-12)))
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b4.bias is not None)
                lin.weight.copy_(w + delta)
                if b4.bias is not None:
                    lin.bias.copy_(b4.bias.float())
                module.set_submodule(name, lin)
            else:
                delta = layer.get_delta_weight("default")
                w = layer.get_base_layer().weight
                rel.append(float(delta.norm() / w.norm().clamp(min=1e-12)))
                layer.merge(safe_merge=True)
                module.set_submodule(name, layer.get_base_layer())
            stats["layers"] += 1
    for p in module.parameters():
        p.requires_grad_(False)
    if rel:
        stats["mean_relative_update"] = float(np.mean(rel))
    if lost:
        stats["repack_lost_fraction"] = float(np.mean(lost))
    return stats


def _repack(qlinear: Any, weight: Any) -> None:
    """Re-round a float (out, in) weight onto ``qlinear``'s own grid (its scales and zero
    points stay), in place: ``q = clamp(round(w / scale) + zero, 0, 2**bits - 1)``."""
    from edgekit.compress.rtn import group_width, quantize_int

    torch = _torch()
    cols = int(qlinear.in_features)
    g = group_width(cols, int(qlinear.group_size))
    col_group = torch.arange(cols) // g  # (in,)
    scales = qlinear.scales.float()  # (out, G)
    zeros = qlinear.zeros().float()  # (out, G)
    q = quantize_int(weight.float(), scales[:, col_group], zeros[:, col_group], int(qlinear.bits))
    qlinear.set_quantized(q.to(torch.uint8), scales, zeros.to(torch.uint8))


def to_nf4(handle: ModelHandle, names: list[str]) -> int:
    """Replace the named float ``nn.Linear`` layers by bitsandbytes NF4 ``Linear4bit`` (CPU)."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken native library
        raise UnavailableError(f"--qlora-base nf4 needs bitsandbytes (pip install bitsandbytes): {e}") from None
    torch = _torch()
    module = handle.module
    n = 0
    for name in names:
        lin = module.get_submodule(name)
        if not isinstance(lin, torch.nn.Linear):
            continue
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.float32, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(lin.weight.data.float().contiguous(), requires_grad=False,
                                     quant_type="nf4")._quantize("cpu")
        q.weight.module = q
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.data.float(), requires_grad=False)
        # Its CPU inference repack (after a no-grad eval forward) breaks training and
        # dequantization: keep the plain NF4 layout.
        q.support_avx512bf16_for_cpu = False
        module.set_submodule(name, q)
        n += 1
    return n


def load_adapter(handle: ModelHandle, tensors: dict[str, Any]) -> None:
    """Copy adapter tensors (``adapter_state`` names) into an injected model; BadInputError
    when they do not fit it (a module it lacks, or a shape for another rank/size)."""
    own = handle.module.state_dict()
    for k, v in tensors.items():
        if k not in own:
            layer = k.split(".lora_")[0]
            raise BadInputError(f"adapter does not fit {handle.name!r}: it has no LoRA layer {layer!r}")
        if tuple(own[k].shape) != tuple(v.shape):
            raise BadInputError(f"adapter does not fit {handle.name!r}: {k} is {tuple(v.shape)} in the adapter "
                                f"but {tuple(own[k].shape)} in the model (another rank or base model?)")
    missing = sorted(k for k in own if (".lora_A." in k or ".lora_B." in k) and k not in tensors)
    if missing:
        raise BadInputError(f"adapter does not fit {handle.name!r}: it lacks {missing[0]} "
                            f"(and {len(missing) - 1} more)")
    handle.module.load_state_dict(tensors, strict=False)


# ----------------------------------------------------------------------------------------
# Data, loss and the training loop


class LoadedData(str):
    """Samples already loaded, passed through ``StepContext.train`` / ``.eval`` so the lora
    step does not load them again. It *is* the data spec string (``"fashion-mnist"``), so
    later steps of the chain (``int8``, ``int4``) and manifests see the plain spec."""

    samples: Any

    def __new__(cls, samples: Any, spec: str | None = None) -> LoadedData:
        obj = super().__new__(cls, spec if spec is not None else str(getattr(samples, "source", "data")))
        obj.samples = samples
        return obj


def _n_samples(samples: Any) -> int:
    arrays = list(samples.inputs.values())
    return int(arrays[0].shape[0]) if arrays else 0


def _batch(handle: ModelHandle, samples: Any, idx: np.ndarray) -> tuple[list[Any], Any]:
    torch = _torch()
    names = [s.name for s in handle.inputs] or list(samples.inputs)
    missing = [n for n in names if n not in samples.inputs]
    if missing:
        raise BadInputError(f"data {getattr(samples, 'source', '?')!r} has inputs {sorted(samples.inputs)}, "
                            f"but the model takes {names}")
    xs = [torch.from_numpy(np.ascontiguousarray(samples.inputs[n][idx])) for n in names]
    labels = getattr(samples, "labels", None)
    y = torch.from_numpy(np.ascontiguousarray(labels[idx])).long() if labels is not None else None
    return xs, y


def _loss(handle: ModelHandle, module: Any, xs: list[Any], y: Any) -> tuple[Any, int]:
    """Mean loss of one batch and its number of scored targets (tokens or samples)."""
    torch = _torch()
    F = torch.nn.functional
    out = module(*xs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if handle.kind == "causal-lm":
        ids = xs[0]
        mask = xs[1] if len(xs) > 1 else torch.ones_like(ids)
        logits = out[:, :-1].reshape(-1, out.shape[-1]).float()
        target = ids[:, 1:].reshape(-1).clone()
        target[mask[:, 1:].reshape(-1) == 0] = -100
        n = int((target != -100).sum())
        return F.cross_entropy(logits, target, ignore_index=-100), n
    if y is None:
        raise BadInputError(f"fine-tuning {handle.name!r} ({handle.kind}) needs labelled data "
                            "(an image classification set such as fashion-mnist, or .npz with labels)")
    return F.cross_entropy(out.float(), y), int(y.shape[0])


def evaluate_loss(handle: ModelHandle, samples: Any, batch_size: int = 8, limit: int | None = None) -> dict[str, float]:
    """Mean validation loss and the matching task metric (perplexity or accuracy)."""
    torch = _torch()
    module = handle.module
    was_training = module.training
    module.eval()
    n = _n_samples(samples) if limit is None else min(limit, _n_samples(samples))
    total, count, correct = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(n, start + batch_size))
            xs, y = _batch(handle, samples, idx)
            loss, k = _loss(handle, module, xs, y)
            total += float(loss) * k
            count += k
            if handle.kind != "causal-lm" and y is not None:
                out = module(*xs)
                out = out[0] if isinstance(out, (tuple, list)) else out
                correct += int((out.argmax(-1) == y).sum())
    module.train(was_training)
    mean = total / max(count, 1)
    if handle.kind == "causal-lm":
        return {"loss": mean, "perplexity": float(math.exp(min(mean, 50.0)))}
    return {"loss": mean, "accuracy": correct / max(count, 1)}


def _fingerprint(handle: ModelHandle, config: LoraConfig, names: list[str], seed: int, data: str) -> str:
    from edgekit.artifact import sha256_json

    return sha256_json({"config": config_to_dict(config), "source": handle.source,
                        "steps": [s.name for s in handle.steps], "modules": names, "seed": seed, "data": data})


def _save_checkpoint(path: Path, module: Any, opt: Any, step: int, fingerprint: str, history: list[float]) -> None:
    from edgekit.artifact import atomic_write_bytes

    torch = _torch()
    buf = io.BytesIO()
    torch.save({"fingerprint": fingerprint, "step": step, "adapter": adapter_state(module),
                "optimizer": opt.state_dict(), "history": history,
                "rng": torch.get_rng_state()}, buf)
    atomic_write_bytes(path, buf.getvalue())


def _train(handle: ModelHandle, config: LoraConfig, train: Any, ctx: StepContext, fingerprint: str,
           resume: bool = True) -> dict[str, Any]:
    """AdamW over the trainable (adapter) parameters; returns training metrics."""
    torch = _torch()
    module = handle.module
    n = _n_samples(train)
    bs = config.batch_size
    if n < bs:
        raise BadInputError(f"training data has {n} sample(s), fewer than one batch of {bs}; "
                            "give more data or a smaller --batch-size")
    per_epoch = n // bs  # drop the last partial batch: equal batches, reproducible steps
    total = config.steps or (config.epochs or 1) * per_epoch
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        t = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))  # cosine to 10%

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    ckpt = Path(ctx.work_dir) / CHECKPOINT if ctx.work_dir is not None else None
    start, history = 0, []
    if resume and ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if state.get("fingerprint") == fingerprint:
            load_adapter(handle, state["adapter"])
            opt.load_state_dict(state["optimizer"])
            start, history = int(state["step"]), list(state["history"])
            torch.set_rng_state(state["rng"])
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at, last_epoch=start - 1) if start else sched
    order_rng = np.random.default_rng(ctx.seed)
    with frozen_packed_forwards(module):
        return _train_loop(handle, config, train, ctx, fingerprint, module, opt, sched, params, ckpt, start, history,
                           total, per_epoch, order_rng)


def _train_loop(handle: ModelHandle, config: LoraConfig, train: Any, ctx: StepContext, fingerprint: str, module: Any,
                opt: Any, sched: Any, params: list[Any], ckpt: Path | None, start: int, history: list[float],
                total: int, per_epoch: int, order_rng: Any) -> dict[str, Any]:
    from edgekit.progress import progress_bar

    torch = _torch()
    n = _n_samples(train)
    bs = config.batch_size
    orders = [order_rng.permutation(n) for _ in range(math.ceil(total / per_epoch))]
    module.train()
    t0 = time.perf_counter()
    step = start
    try:
        for step in progress_bar(range(start, total), f"LoRA fine-tuning ({len(params)} tensors)",
                                 total=total - start, enabled=None if ctx.progress else False):
            order = orders[step // per_epoch]
            j = step % per_epoch
            xs, y = _batch(handle, train, order[j * bs:(j + 1) * bs])
            loss, _ = _loss(handle, module, xs, y)
            if not torch.isfinite(loss):
                raise BadInputError(f"training loss became {float(loss)} at step {step}; lower --lr ({config.lr})")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            sched.step()
            history.append(float(loss.detach()))
            done = step + 1
            if ckpt is not None and config.checkpoint_every and done % config.checkpoint_every == 0 and done < total:
                _save_checkpoint(ckpt, module, opt, done, fingerprint, history)
        step = total
    except KeyboardInterrupt:
        if ckpt is not None and step > start:
            _save_checkpoint(ckpt, module, opt, step, fingerprint, history)
        raise
    seconds = time.perf_counter() - t0
    module.eval()
    if ckpt is not None:
        with contextlib.suppress(FileNotFoundError):
            ckpt.unlink()
    ran = total - start
    tail = history[-max(1, min(10, len(history))):]
    return {"steps": total, "resumed_from": start, "train_seconds": round(seconds, 3),
            "seconds_per_step": round(seconds / ran, 4) if ran else None,
            "train_loss_first": history[0] if history else None, "train_loss_last": float(np.mean(tail)) if tail else None,
            "loss_history": [round(v, 5) for v in history]}


# ----------------------------------------------------------------------------------------
# The step


def trainable_parameters(module: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; packed int4 buffers count as their weights'."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    for m in module.modules():
        if _is_quant_linear(m):
            total += int(m.in_features) * int(m.out_features)
    return trainable, total


def apply(handle: ModelHandle, config: LoraConfig, ctx: StepContext) -> ModelHandle:
    """Train adapters on ``ctx.train`` (validated on ``ctx.eval``), then merge or keep them."""
    torch = _torch()
    if handle.module is None:
        raise BadInputError(f"{handle.name!r} is an ONNX-only model; LoRA needs the PyTorch model")
    for s in handle.steps:
        if s.name == "int8":
            raise BadInputError(
                "LoRA over an INT8 fake-quant model is not supported: fine-tune the float model and re-quantize "
                "(edgekit finetune MODEL --requant int8), so PTQ recalibrates the merged weights")
        if s.name == "lora" and not s.meta.get("merged", True):
            raise BadInputError("this model already carries unmerged LoRA adapters; merge them first (--merge)")
    base = _base_kind(handle.module)
    if config.qlora:
        if config.qlora_base == "packed" and base != "packed":
            raise BadInputError(f"--qlora trains over edgekit's packed 4-bit model, but {handle.name!r} is {base}: "
                                "run `edgekit compress MODEL --bits 4 -o Q` and fine-tune Q, "
                                "or use --qlora-base nf4 (bitsandbytes) on the float model")
        if config.qlora_base == "nf4" and base != "float":
            raise BadInputError(f"--qlora-base nf4 quantizes a float model itself; {handle.name!r} is already {base}")
    elif base == "packed":
        raise BadInputError(f"{handle.name!r} has packed 4-bit weights: add --qlora to train adapters over them")
    torch.manual_seed(ctx.seed)
    names = resolve_targets(handle, config.targets, base)
    train = resolve_samples(ctx.train, handle, "train", config.train_samples, config.seqlen, ctx.seed)
    val = resolve_samples(ctx.eval, handle, "eval", config.eval_samples, config.seqlen, ctx.seed)
    if _n_samples(train) < config.batch_size:
        raise BadInputError(f"training data has {_n_samples(train)} sample(s), fewer than one batch of "
                            f"{config.batch_size}; give more data or a smaller --batch-size")
    if _n_samples(val) == 0:
        raise BadInputError("validation data is empty; give --eval-data")
    metrics: dict[str, Any] = {"modules": len(names), "base": base if not config.qlora else config.qlora_base}
    vb = min(config.batch_size, 8)
    if config.qlora and config.qlora_base == "nf4":
        linears = [n for n in candidate_modules(handle, "float")
                   if isinstance(handle.module.get_submodule(n), torch.nn.Linear) and not _is_head(n, handle)]
        metrics["nf4_layers"] = to_nf4(handle, linears)
        base = "nf4"
    metrics["before"] = evaluate_loss(handle, val, vb, config.eval_samples)
    inject(handle, config, names, base)
    trainable, total = trainable_parameters(handle.module)
    metrics.update(trainable_params=trainable, total_params=total,
                   trainable_share=round(trainable / max(total, 1), 6))
    data_name = str(getattr(train, "source", ctx.train))
    fp = _fingerprint(handle, config, names, ctx.seed, data_name)
    metrics.update(_train(handle, config, train, ctx, fp, resume=getattr(ctx, "resume", True)))
    metrics["after"] = evaluate_loss(handle, val, vb, config.eval_samples)
    handle.extra["lora_adapter"] = adapter_state(handle.module)
    merge = config.merge if config.merge is not None else base != "packed"
    if merge:
        metrics["merge"] = merge_adapters(handle)
        metrics["after_merge"] = evaluate_loss(handle, val, vb, config.eval_samples)
    metrics["train_data"] = data_name
    metrics["eval_data"] = str(getattr(val, "source", ctx.eval))
    handle.module.eval()
    ctx.metrics["lora"] = {k: v for k, v in metrics.items() if k != "loss_history"}
    ctx.metrics["lora_loss_history"] = metrics.get("loss_history", [])
    handle.steps.append(StepRecord("lora", config_to_dict(config), {
        "modules": names, "merged": bool(merge), "base": base, "r": config.r, "alpha": config.alpha,
        "trainable_params": trainable}))
    return handle


def rebuild(handle: ModelHandle, config: LoraConfig, record: StepRecord) -> ModelHandle:
    """Recreate the adapter layers (unmerged) so the saved weights load strictly. A merged
    record changed no structure (float, or packed re-rounded in place); nf4 merges to float
    ``nn.Linear`` layers of the same names and shapes as the base's."""
    if record.meta.get("merged", True):
        return handle
    names = list(record.meta.get("modules") or [])
    present = {n for n, _ in handle.module.named_modules()}
    lacking = [n for n in names if n not in present]
    if lacking:
        raise BadInputError(f"adapters do not fit {handle.name!r}: it has no module {lacking[0]!r} "
                            f"(and {len(lacking) - 1} more); was the adapter trained on another model?")
    base = record.meta.get("base", "float")
    if base == "packed" and _base_kind(handle.module) != "packed":
        raise BadInputError(f"adapters were trained over packed 4-bit layers but {handle.name!r} has none")
    inject(handle, config, names, "packed" if base == "packed" else "float")
    handle.module.eval()
    return handle


def weight_transitions(config: LoraConfig) -> tuple[dict[str, str], str]:
    """What LoRA takes with these options: plain LoRA and NF4 QLoRA a float model (merged
    back to float), packed QLoRA edgekit's packed 4-bit model (adapters beside the codes)."""
    if config.qlora and config.qlora_base == "packed":
        return {"packed": "packed"}, "qlora over packed weights"
    if config.qlora:
        return {"float": "float"}, "qlora_base nf4 quantizes float weights itself"
    return {"float": "float"}, "plain LoRA; qlora: true trains over packed weights"


STEP = Step(
    name="lora",
    config=LoraConfig,
    apply=apply,
    rebuild=rebuild,
    description="LoRA / QLoRA fine-tuning (peft on float models; adapters over packed 4-bit or NF4 bases)",
    transitions={"float": "float", "packed": "packed"},
    narrow=weight_transitions,
)

__all__ = ["LoraConfig", "LoraQuantLinear", "STEP", "adapter_state", "apply", "candidate_modules",
           "evaluate_loss", "inject", "load_adapter", "merge_adapters", "rebuild", "resolve_targets",
           "to_nf4", "trainable_parameters"]
