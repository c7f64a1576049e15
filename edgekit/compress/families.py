"""What weight-only algorithms need to know about a model family, read from the model itself.

Quantizing a layer must not change what the surrounding model computes. Most of that is
generic (packed layers are checked numerically where they replace a module, see
``weight_only.pack_module``), but some algorithms rewrite *neighbouring* modules and must
know how the family wires them:

* AWQ folds ``1/s`` into the op producing a group's input: which norm feeds which
  projections (Gemma 2/3 feed the MLP from ``pre_feedforward_layernorm``, not from
  ``post_attention_layernorm`` as Llama does), whether the norm multiplies by ``w`` or by
  ``1 + w`` (Gemma's RMSNorm), and which linears feed which (``up_proj -> down_proj``,
  ``v_proj -> o_proj`` when heads are not grouped).
* GPTQ's attention-aware Hessian needs the value projection of each attention module.
* Packing the input embedding must keep a scaled embedding's factor (Gemma 3 multiplies
  the looked-up rows by ``sqrt(hidden)`` inside its embedding module).
* GPT-2's projections are transformers' ``Conv1D``, a linear layer whose weight is stored
  transposed, (in, out). ``linearize`` swaps each for the ``nn.Linear`` it computes (weight
  transposed, same bias), checked numerically against the ``Conv1D``'s own forward on the spot,
  so the weight-only algorithms and the packed layers meet one kind of layer.

``family_of(module)`` finds the Hugging Face model inside ``module`` and returns its
``Family`` from ``config.model_type``; a Hugging Face model of a type not listed here is
an unknown family (``known=False``: AWQ then measures its fold pairs, ``wiring.py``),
and a plain PyTorch module (no transformers config) is ``GENERIC``: no folding, no
value-projection Hessian, nothing guessed.

>>> from transformers import Gemma3TextConfig, Gemma3ForCausalLM  # doctest: +SKIP
>>> family_of(Gemma3ForCausalLM(Gemma3TextConfig(...))).norm_offset  # doctest: +SKIP
1.0
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgekit.errors import BadInputError, CheckFailedError


@dataclass(frozen=True)
class ScalePair:
    """``producer`` (a path inside a block) computes the input of ``consumers`` (paths inside the
    block). A 1-d producer weight is a norm (``y = x_hat * (offset + w) [+ b]``); a 2-d one a linear
    whose output rows feed the consumers."""

    producer: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """The structure of one model family that algorithms rely on (paths relative to one block)."""

    name: str
    model_types: tuple[str, ...]
    scale_pairs: tuple[ScalePair, ...] = ()
    norm_offset: float = 0.0  # 1.0 where the norm computes x_hat * (1 + w) (Gemma)
    value_proj: str | None = None  # attention value projection, "self_attn.v_proj"
    out_proj: str | None = None  # the projection reading the attention output, "self_attn.o_proj"
    known: bool = True
    # config attributes the description assumes, with their values (OPT: pre-norm layers only)
    requires: tuple[tuple[str, object], ...] = ()

    def pair_for(self, consumer: str) -> ScalePair | None:
        """The pair whose consumers include ``consumer`` (a path inside the block)."""
        for p in self.scale_pairs:
            if consumer in p.consumers:
                return p
        return None


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")
_LLAMA_PAIRS = (ScalePair("input_layernorm", _ATTN), ScalePair("post_attention_layernorm", _MLP),
                ScalePair("mlp.up_proj", ("mlp.down_proj",)), ScalePair("self_attn.v_proj", ("self_attn.o_proj",)))
_GEMMA2_PAIRS = (ScalePair("input_layernorm", _ATTN), ScalePair("pre_feedforward_layernorm", _MLP),
                 ScalePair("mlp.up_proj", ("mlp.down_proj",)), ScalePair("self_attn.v_proj", ("self_attn.o_proj",)))

_OPT_PAIRS = (ScalePair("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
              ScalePair("final_layer_norm", ("fc1",)), ScalePair("self_attn.v_proj", ("self_attn.out_proj",)))
# GPT-NeoX: input_layernorm feeds only the attention and post_attention_layernorm only the MLP, with
# the parallel residual (x + attn(ln1(x)) + mlp(ln2(x))) as without it (mlp(ln2(x + attn(ln1(x))))).
_NEOX_PAIRS = (ScalePair("input_layernorm", ("attention.query_key_value",)),
               ScalePair("post_attention_layernorm", ("mlp.dense_h_to_4h",)))
# GPT-2 (its Conv1D layers seen as nn.Linear, see ``linearize``): ln_1 feeds the fused q/k/v, ln_2 the MLP
_GPT2_PAIRS = (ScalePair("ln_1", ("attn.c_attn",)), ScalePair("ln_2", ("mlp.c_fc",)))

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "mistral", "qwen2", "qwen3", "smollm3"), _LLAMA_PAIRS,
           value_proj="self_attn.v_proj", out_proj="self_attn.o_proj"),
    Family("gemma", ("gemma",), _LLAMA_PAIRS, norm_offset=1.0,
           value_proj="self_attn.v_proj", out_proj="self_attn.o_proj"),
    Family("gemma2/3", ("gemma2", "gemma3", "gemma3_text"), _GEMMA2_PAIRS, norm_offset=1.0,
           value_proj="self_attn.v_proj", out_proj="self_attn.o_proj"),
    Family("phi3", ("phi3",), (ScalePair("input_layernorm", ("self_attn.qkv_proj",)),
                               ScalePair("post_attention_layernorm", ("mlp.gate_up_proj",)))),
    Family("opt", ("opt",), _OPT_PAIRS, requires=(("do_layer_norm_before", True),)),
    Family("gpt-neox", ("gpt_neox",), _NEOX_PAIRS),
    Family("gpt2", ("gpt2",), _GPT2_PAIRS),
)
GENERIC = Family("generic", (), known=True)  # a plain PyTorch module: nothing to fold, nothing guessed


def hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost module carrying a transformers config (``config.model_type``)."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and isinstance(getattr(cfg, "model_type", None), str):
            return m
    return None


def family_of(module: nn.Module) -> Family:
    """The family of the (Hugging Face) model inside ``module``; ``GENERIC`` for plain modules
    and an unknown family (``known=False``) for Hugging Face types not described here."""
    hf = hf_model(module)
    if hf is None:
        return GENERIC
    config = getattr(hf, "config", None)  # a transformers PretrainedConfig (hf_model checked model_type)
    model_type = str(getattr(config, "model_type", ""))
    for fam in FAMILIES:
        if model_type in fam.model_types:
            unmet = [f"{k}={getattr(config, k, None)!r}" for k, v in fam.requires if getattr(config, k, None) != v]
            if unmet:  # a variant the description does not fit (OPT-350m's post-norm layers)
                return Family(f"{model_type} with {', '.join(unmet)}", (model_type,), known=False)
            return fam
    return Family(model_type, (model_type,), known=False)


def norm_offset(norm: nn.Module, family: Family) -> float:
    """The constant added to a norm's weight in its forward (1 for Gemma's ``x * (1 + w)``),
    checked numerically on the norm itself: a family description that does not fit stops."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise BadInputError(f"expected a norm with a 1-d weight, got {type(norm).__name__}")
    probe = torch.randn(2, w.shape[0], generator=torch.Generator().manual_seed(0), dtype=w.dtype).to(w.device)
    with torch.no_grad():
        base = norm(probe)
        saved = w.data.clone()
        w.data.mul_(2).add_(family.norm_offset)  # offset + w -> 2 (offset + w): the output doubles
        try:
            doubled = norm(probe)
        finally:
            w.data.copy_(saved)
        bias = getattr(norm, "bias", None)
        shift = bias.detach() if isinstance(bias, torch.Tensor) else 0.0
    if not torch.allclose(doubled - shift, 2 * (base - shift), rtol=1e-4, atol=1e-5):
        raise BadInputError(f"{type(norm).__name__} does not compute x_hat * ({family.norm_offset:g} + weight) "
                            f"as the {family.name} family description says; refusing to fold scales into it")
    return family.norm_offset


def embedding_scale(emb: nn.Module) -> float:
    """The factor a (scaled) embedding module applies to the rows it looks up, measured on the
    module: 1.0 for ``nn.Embedding``, sqrt(hidden) for Gemma 3's scaled embedding. A forward that is
    not a row lookup times one constant stops (nothing guessed)."""
    w = getattr(emb, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise BadInputError(f"{type(emb).__name__} has no 2-d embedding table")
    rows = min(w.shape[0], 64)
    ids = torch.linspace(0, w.shape[0] - 1, rows).long().to(w.device)[None]
    with torch.no_grad():
        out = emb(ids)[0].float()
        table = w[ids[0]].float()
    if out.shape != table.shape:
        raise BadInputError(f"{type(emb).__name__} does not return one row per id; it cannot be packed")
    denom = float((table * table).sum())
    scale = float((out * table).sum() / denom) if denom > 0 else 1.0
    if not torch.allclose(out, table * scale, rtol=1e-4, atol=1e-6 * max(1.0, abs(scale))):
        raise BadInputError(f"{type(emb).__name__} computes more than a scaled row lookup; edgekit cannot pack it "
                            "without changing what the model computes (use --head none)")
    return scale


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): ``y = x @ W + b`` with ``W`` (in, out);
    checked without importing transformers."""
    cls = type(module)
    w = getattr(module, "weight", None)
    return (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")
            and isinstance(w, torch.Tensor) and w.dim() == 2)


@torch.no_grad()
def conv1d_as_linear(name: str, conv: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` a ``Conv1D`` computes (weight transposed to (out, in), same bias), checked
    on a probe input against the ``Conv1D``'s own forward (``CheckFailedError`` if it differs)."""
    w = conv.weight
    bias = getattr(conv, "bias", None)
    if not isinstance(w, torch.Tensor) or (bias is not None and not isinstance(bias, torch.Tensor)):
        raise CheckFailedError(f"{name!r} ({type(conv).__name__}) has no weight tensor to read as a linear layer")
    nx, nf = w.shape
    lin = nn.Linear(nx, nf, bias=bias is not None, device=w.device, dtype=w.dtype)
    lin.weight.copy_(w.t())
    if bias is not None:
        lin.bias.copy_(bias)
    lin.train(conv.training)
    x = torch.randn(2, 3, nx, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    want, got = conv(x), lin(x)
    scale = float(want.abs().max()) if want.numel() else 0.0
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0)):
        raise CheckFailedError(f"{name!r} ({type(conv).__name__}) does not compute x @ weight + bias; edgekit "
                               "does not replace modules it cannot reproduce")
    return lin


def linearize(module: nn.Module) -> list[str]:
    """Replace every ``Conv1D`` inside ``module`` by the ``nn.Linear`` it computes
    (``conv1d_as_linear``); returns the names replaced. Nothing the model computes changes."""
    names = [n for n, m in module.named_modules() if n and is_conv1d(m)]
    for n in names:
        module.set_submodule(n, conv1d_as_linear(n, module.get_submodule(n)))
    return names


def block_path(module: nn.Module, block: nn.Module, name: str) -> str:
    """``name`` (a path in ``module``) relative to ``block``."""
    for n, m in module.named_modules():
        if m is block:
            return name[len(n) + 1:] if n else name
    raise ValueError("block not inside module")


__all__ = ["Family", "ScalePair", "FAMILIES", "GENERIC", "family_of", "norm_offset",
           "embedding_scale", "hf_model", "block_path", "is_conv1d", "conv1d_as_linear",
           "linearize"]

