"""Structured pruning with Torch-Pruning's dependency graph: remove whole channels.

The model becomes a plain, smaller dense model. Torch-Pruning's ``DependencyGraph``
finds the groups of coupled channels (a residual add ties the channels of every conv
that feeds it; a depthwise conv ties its input to its output; a concatenation maps
indices across its inputs) and a ``MetaPruner`` removes the least important channels
of each group consistently. The classifier head (the layer producing the model's
output) and any ``ignore``-named layers keep their output channels.

Causal LMs (Llama family: SmolLM2, Qwen2, Gemma) keep their hidden size (the
residual stream) and lose MLP intermediate channels (``gate_proj``/``up_proj`` rows
and ``down_proj`` columns, through the dependency graph) and/or attention heads
(whole query heads, the same number within every key/value group so grouped-query
attention stays valid; ``o_proj`` columns follow). The attention modules' head
counts and the Hugging Face config are updated.

Saving stores no code: the step record's ``meta`` keeps the new shape of every
tensor and the changed layer attributes (``out_channels``, ``groups``, ...), and
``rebuild`` recreates those shapes on a freshly loaded base model before the
weights load strictly.

>>> from edgekit.compress import compress
>>> compress("fmnist-cnn", [("prune", PruneConfig(ratio=0.5))], "out/pruned")  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edgekit.compress import Step, StepContext, config_to_dict, step_rewrite
from edgekit.compress.prune_config import PruneConfig
from edgekit.errors import BadInputError, CheckFailedError
from edgekit.sources.data import load_samples
from edgekit.sources.handle import ModelHandle, StepRecord

# Layer attributes that pruning may change and rebuild must restore.
_ATTRS = ("in_channels", "out_channels", "groups", "in_features", "out_features", "num_features",
          "normalized_shape", "num_embeddings", "embedding_dim", "num_channels", "num_groups",
          "num_heads", "num_key_value_heads", "num_key_value_groups", "head_dim", "hidden_size",
          "intermediate_size", "num_attention_heads", "all_head_size")
_HF_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")


# ----------------------------------------------------------------------------- helpers


def example_inputs(handle: ModelHandle, batch: int = 1) -> tuple[Any, ...]:
    """The handle's sample inputs as a tuple of tensors, in ``handle.inputs`` order."""
    import torch

    feeds = handle.sample_inputs(batch)
    names = [i.name for i in handle.inputs] or list(feeds)
    return tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)


def _first_output(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return out[0]
    if hasattr(out, "logits"):
        return out.logits
    return out


def find_output_layers(module: Any, inputs: tuple[Any, ...]) -> list[str]:
    """Names of the conv/linear layers whose output channels are the model's output
    channels (the classifier head; an LM head): the last such layer run whose output
    size matches the model output's feature axis, among the layers the output depends on
    (BERT's pooler runs last, but a sentence embedding pooled from the hidden states does not
    read it)."""
    import torch

    runs: list[tuple[str, tuple[int, ...], Any]] = []
    hooks = []
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            hooks.append(m.register_forward_hook(
                lambda mod, args, out, name=name: runs.append((name, tuple(_first_output(out).shape),
                                                               _first_output(out)))))
    try:
        with torch.enable_grad():
            out = _first_output(module(*inputs))
            tracked = [i for i, r in enumerate(runs) if isinstance(r[2], torch.Tensor) and r[2].requires_grad]
            if out.requires_grad and tracked:
                grads = torch.autograd.grad(out.float().sum(), [runs[i][2] for i in tracked], allow_unused=True)
                unused = {i for i, g in zip(tracked, grads) if g is None}
                runs = [r for i, r in enumerate(runs) if i not in unused]
    finally:
        for h in hooks:
            h.remove()
    shape = tuple(out.shape)
    for name, s, _ in reversed(runs):
        if s == shape or (len(s) >= 2 and len(shape) >= 2 and s[-1] == shape[-1] and len(shape) <= 3) \
                or (len(s) == 4 and len(shape) == 2 and s[1] == shape[1]):
            return [name]
    return []


def resolve_ignore(module: Any, patterns: tuple[str, ...]) -> list[str]:
    """Module names matched by ``patterns`` (exact name, a parent name, or a glob)."""
    names = [n for n, _ in module.named_modules() if n]
    matched: list[str] = []
    for pat in patterns:
        hits = [n for n in names if n == pat or n.startswith(pat + ".") or fnmatch.fnmatchcase(n, pat)]
        if not hits:
            leaves = [n for n, m in module.named_modules() if n and not list(m.children())]
            close = [n for n in leaves if pat.split(".")[-1] in n][:8] or leaves[:8]
            raise BadInputError(f"--ignore {pat!r} names no layer (layers include: {', '.join(close)})")
        matched += hits
    return matched


def _snapshot(module: Any) -> tuple[dict[str, list[int]], dict[str, dict[str, Any]]]:
    shapes = {k: list(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    attrs: dict[str, dict[str, Any]] = {}
    for name, m in module.named_modules():
        vals = {}
        for a in _ATTRS:
            v = getattr(m, a, None) if a in vars(m) else None
            if isinstance(v, (int, tuple, list)) and not isinstance(v, bool):
                vals[a] = list(v) if isinstance(v, (tuple, list)) else v
        if vals:
            attrs[name] = vals
    return shapes, attrs


def _hf_config(module: Any) -> Any:
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict") and hasattr(cfg, "num_hidden_layers"):
            return cfg
    return None


def count_macs(module: Any, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Multiply-accumulates of one forward pass on ``inputs``, total and per conv/linear
    layer (forward hooks: out elements x (in channels / groups) x kernel size), and
    parameters. Convs and linears are counted by class, so subclasses (same-padding
    convs) count too; other ops (activations, norms, attention matmuls) are not MACs of
    weights and are left out, like Torch-Pruning's ``count_ops_and_params`` does for most."""
    import torch

    layers: dict[str, dict[str, int]] = {}
    hooks = []

    def hook(name: str) -> Callable[[Any, Any, Any], None]:
        def fn(mod: Any, args: Any, out: Any) -> None:
            out = _first_output(out)
            if isinstance(mod, torch.nn.Linear):
                macs = out.numel() * mod.in_features
            else:
                k = int(np.prod(mod.kernel_size))
                macs = out.numel() * (mod.in_channels // mod.groups) * k
            entry = layers.setdefault(name, {"macs": 0, "params": sum(p.numel() for p in mod.parameters(False))})
            entry["macs"] += int(macs)
        return fn

    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return {"macs": int(sum(v["macs"] for v in layers.values())),
            "params": int(sum(p.numel() for p in module.parameters())), "layers": layers}


def _calibration_batches(handle: ModelHandle, ctx: StepContext | None, config: PruneConfig) -> list[tuple[tuple[Any, ...], Any]]:
    """(inputs, labels-or-None) batches for Taylor importance."""
    import torch

    names = [i.name for i in handle.inputs]
    spec = (ctx.calib if ctx is not None else None) or handle.default_calib
    if spec is None:
        return [(example_inputs(handle, 8), None)]
    is_lm = handle.kind == "causal-lm"
    bs = 2 if is_lm else 8  # LM: 2 windows of 256 tokens per batch
    try:

        samples = load_samples(spec, handle, split="calib", seed=ctx.seed if ctx is not None else 0,
                               **({"seqlen": 256} if is_lm else {}))
    except (ImportError, ModuleNotFoundError):
        return [(example_inputs(handle, 8), None)]
    out = []
    for i, b in enumerate(samples.batches(bs)):
        if i >= config.calib_batches:
            break
        labels = None
        if samples.labels is not None:
            labels = torch.from_numpy(np.asarray(samples.labels[i * bs:i * bs + len(next(iter(b.values())))]))
        out.append((tuple(torch.from_numpy(np.ascontiguousarray(b[n])) for n in names), labels))
    return out or [(example_inputs(handle, 8), None)]


def _taylor_loss(handle: ModelHandle, out: Any, inputs: tuple[Any, ...], labels: Any) -> Any:
    import torch.nn.functional as F

    logits = _first_output(out)
    if handle.kind == "causal-lm":
        ids = inputs[0]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).long())
    if logits.dim() > 2:
        logits = logits.flatten(1)
    target = labels.long() if labels is not None else logits.detach().argmax(-1)
    return F.cross_entropy(logits, target)


# ----------------------------------------------------------------------------- pruning


def _importance(config: PruneConfig) -> Any:
    import torch_pruning as tp

    if config.importance == "l1":
        return tp.importance.GroupMagnitudeImportance(p=1)
    if config.importance == "l2":
        return tp.importance.GroupMagnitudeImportance(p=2)
    if config.importance == "taylor":
        return tp.importance.GroupTaylorImportance()
    return tp.importance.BNScaleImportance()


def _llama_layers(module: Any) -> list[tuple[str, Any]]:
    """(name, decoder layer) pairs of a Llama-style model (self_attn + mlp)."""
    out = []
    for name, m in module.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        if attn is not None and mlp is not None and hasattr(attn, "q_proj") and hasattr(mlp, "gate_proj"):
            out.append((name, m))
    return out


def prune_module(handle: ModelHandle, config: PruneConfig, ctx: StepContext | None = None) -> dict[str, Any]:
    """Prune ``handle.module`` in place; returns facts for the step record (no shapes)."""
    import torch
    import torch_pruning as tp

    module = handle.module
    if module is None:
        raise BadInputError(f"pruning needs a PyTorch model; {handle.name} is ONNX only")
    module.eval()
    inputs = example_inputs(handle, 1)
    is_lm = handle.kind == "causal-lm"
    scope = config.scope if config.scope != "auto" else ("mlp" if is_lm else "channels")
    if not is_lm and scope != "channels":
        raise BadInputError(f"pruning scope {scope!r} is for causal LMs; {handle.name} is a {handle.kind} "
                            "(use 'channels')")
    by_name = dict(module.named_modules())
    protected = find_output_layers(module, inputs)
    user = resolve_ignore(module, tuple(config.ignore))
    ignored_names = sorted(set(protected) | set(user))
    ignored = [by_name[n] for n in ignored_names]
    if config.importance == "bn-scale" and not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                                   for m in module.modules()):
        raise BadInputError(f"importance 'bn-scale' needs BatchNorm layers; {handle.name} has none "
                            "(choose from 'l1', 'l2', 'taylor')")
    if config.importance == "auto":
        config = dataclasses.replace(config, importance="taylor" if is_lm else "l2")
    facts: dict[str, Any] = {"scope": scope, "importance": config.importance, "protected": protected,
                             "ignored": sorted(set(user))}
    calib = _calibration_batches(handle, ctx, config) if config.importance == "taylor" else []

    def score_gradients() -> None:
        module.zero_grad(set_to_none=True)
        for x, y in calib:
            with torch.enable_grad():
                _taylor_loss(handle, module(*x), x, y).backward()

    pruner = None
    if scope in ("channels", "mlp", "mlp+heads"):
        if is_lm:
            layers = _llama_layers(module)
            if not layers:
                raise BadInputError(f"causal-LM pruning supports Llama-style models (q_proj/gate_proj); "
                                    f"{handle.name} has no such layers")
            names_of = {id(m): n for n, m in module.named_modules()}
            targets = {id(m) for _, lay in layers for m in (lay.mlp.gate_proj, lay.mlp.up_proj)
                       if names_of[id(m)] not in user}
            ignored = [m for m in module.modules() if isinstance(m, torch.nn.Linear) and id(m) not in targets]
        kwargs: dict[str, Any] = {}
        if is_lm:
            kwargs["output_transform"] = _first_output
        else:
            kwargs.update(_whole_heads(module, config.head_ratio if config.head_ratio is not None else config.ratio))
        import warnings

        with warnings.catch_warnings():  # RMSNorm weights are "unwrapped"; the hidden size is not pruned
            warnings.simplefilter("ignore", UserWarning)
            pruner = tp.pruner.MetaPruner(
                module, example_inputs=inputs, importance=_importance(config),
                global_pruning=config.global_pruning, pruning_ratio=config.ratio,
                max_pruning_ratio=0.9 if config.global_pruning else 1.0, iterative_steps=config.iterative_steps,
                ignored_layers=ignored, round_to=config.round_to, **kwargs)
    groups = 0
    for _ in range(config.iterative_steps):
        if pruner is not None:
            if config.importance == "taylor":
                score_gradients()
            for group in pruner.step(interactive=True):
                group.prune()
                groups += 1
    module.zero_grad(set_to_none=True)
    facts["groups_pruned"] = groups
    if is_lm and scope in ("heads", "mlp+heads"):
        facts["heads"] = prune_heads(module, config.head_ratio if config.head_ratio is not None else config.ratio,
                                     config.importance, ignored_names=user)
    if is_lm:
        _update_llama_config(module)
    else:
        heads = _update_encoder_heads(module)
        if heads:
            facts["heads"] = heads
    return facts


def _encoder_attentions(module: Any) -> list[tuple[str, Any]]:
    """(name, self-attention) of BERT-style encoders: ``query``/``key``/``value`` linears split
    into ``num_attention_heads`` heads of ``attention_head_size`` (reshaped in the forward)."""
    import torch

    return [(n, m) for n, m in module.named_modules()
            if all(isinstance(getattr(m, a, None), torch.nn.Linear) for a in ("query", "key", "value"))
            and isinstance(getattr(m, "num_attention_heads", None), int)
            and isinstance(getattr(m, "attention_head_size", None), int)]


def _whole_heads(module: Any, ratio: float) -> dict[str, Any]:
    """MetaPruner options that prune BERT-style attention by whole heads (query, key and value
    rows of the same heads, the output projection's columns with them), so the forward's reshape
    to (heads, head size) stays valid; at least one head stays in every layer."""
    attns = _encoder_attentions(module)
    if not attns:
        return {}
    fewest = min(a.num_attention_heads for _, a in attns)
    num_heads = {lin: a.num_attention_heads for _, a in attns for lin in (a.query, a.key, a.value)}
    # Torch-Pruning removes ceil(ratio * heads) heads; keep ratio * heads below heads - 1 + 1
    head_ratio = min(ratio, (fewest - 1) / fewest - 1e-9) if fewest > 1 else 0.0
    return {"num_heads": num_heads, "prune_num_heads": head_ratio > 0, "prune_head_dims": False,
            "head_pruning_ratio": max(head_ratio, 0.0)}


def _update_encoder_heads(module: Any) -> dict[str, Any]:
    """After pruning: each BERT-style attention's head count and width from its query rows."""
    out: dict[str, Any] = {}
    for name, attn in _encoder_attentions(module):
        width = attn.query.out_features
        if width % attn.attention_head_size or width != attn.key.out_features or width != attn.value.out_features:
            raise CheckFailedError(f"pruning left {name} with query/key/value widths {width}/{attn.key.out_features}/"
                                f"{attn.value.out_features}, not whole heads of {attn.attention_head_size}")
        heads = width // attn.attention_head_size
        if heads != attn.num_attention_heads:
            out[name] = {"heads": heads}
        attn.num_attention_heads = heads
        if hasattr(attn, "all_head_size"):
            attn.all_head_size = width
    return out


def prune_heads(module: Any, ratio: float, importance: str = "l2", ignored_names: Sequence[str] = ()) -> dict[str, Any]:
    """Remove query heads of every Llama-style attention layer: ``ceil(ratio * heads /
    kv_heads)`` from each key/value group (so grouped-query attention stays valid),
    scored by the norm of their q_proj rows and o_proj columns; key/value heads stay.
    Uses Torch-Pruning's layer pruning functions for the surgery."""
    import torch
    import torch_pruning as tp

    p = 1 if importance == "l1" else 2
    out = {}
    for name, layer in _llama_layers(module):
        attn = layer.self_attn
        if any(name + ".self_attn" == n or (name + ".self_attn").startswith(n + ".") or n.startswith(name + ".self_attn")
               for n in ignored_names):
            continue
        hd = attn.head_dim
        n_q = attn.q_proj.out_features // hd
        n_kv = attn.k_proj.out_features // hd
        per_group = n_q // n_kv
        remove = min(per_group - 1, math.ceil(ratio * n_q / n_kv)) if ratio > 0 else 0
        if remove <= 0:
            continue
        with torch.no_grad():
            q = attn.q_proj.weight.view(n_q, hd, -1)
            o = attn.o_proj.weight.view(o_rows := attn.o_proj.out_features, n_q, hd)
            score = q.abs().pow(p).sum(dim=(1, 2)) + o.abs().pow(p).sum(dim=(0, 2))
            del o_rows
        drop_heads = []
        for g in range(n_kv):
            s = score[g * per_group:(g + 1) * per_group]
            drop_heads += (torch.topk(s, remove, largest=False).indices + g * per_group).tolist()
        idxs = sorted(i for h in drop_heads for i in range(h * hd, (h + 1) * hd))
        tp.prune_linear_out_channels(attn.q_proj, idxs)
        tp.prune_linear_in_channels(attn.o_proj, idxs)
        out[name] = {"heads": n_q - len(drop_heads), "removed": sorted(drop_heads)}
    return out


def _update_llama_config(module: Any) -> None:
    """After pruning: head counts on each attention module and uniform sizes in the config."""
    layers = _llama_layers(module)
    heads, kv, inter = set(), set(), set()
    for _, layer in layers:
        attn = layer.self_attn
        hd = attn.head_dim
        n_q, n_kv = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd
        attn.num_key_value_groups = n_q // n_kv
        for a, v in (("num_heads", n_q), ("num_key_value_heads", n_kv)):
            if a in vars(attn):
                setattr(attn, a, v)
        heads.add(n_q)
        kv.add(n_kv)
        inter.add(layer.mlp.gate_proj.out_features)
        if "intermediate_size" in vars(layer.mlp):
            layer.mlp.intermediate_size = layer.mlp.gate_proj.out_features
    cfg = _hf_config(module)
    if cfg is not None:
        if len(inter) == 1:
            cfg.intermediate_size = inter.pop()
        if len(heads) == 1:
            cfg.num_attention_heads = heads.pop()
        if len(kv) == 1:
            cfg.num_key_value_heads = kv.pop()


# ----------------------------------------------------------------------------- record / rebuild


def _diff_shapes(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, list[int]]:
    return {k: v for k, v in after.items() if before.get(k) != v}


def _diff_attrs(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, vals in after.items():
        changed = {a: v for a, v in vals.items() if before.get(name, {}).get(a) != v}
        if changed:
            out[name] = changed
    return out


def rebuild(handle: ModelHandle, config: PruneConfig, record: StepRecord) -> ModelHandle:
    """Recreate the pruned shapes recorded in ``record.meta`` on a freshly loaded model
    (placeholder weights; ``load_compressed`` then loads the saved ones strictly)."""
    import torch

    module = handle.module
    if module is None:
        raise BadInputError(f"cannot rebuild a pruned model on {handle.name}: no PyTorch module")
    shapes = record.meta.get("shapes", {})
    for key, shape in shapes.items():
        owner_name, _, attr = key.rpartition(".")
        try:
            owner = module.get_submodule(owner_name) if owner_name else module
        except AttributeError:
            raise BadInputError(f"pruned tensor {key!r} is not in {handle.name}: the base model changed") from None
        old = getattr(owner, attr, None)
        if old is None:
            raise BadInputError(f"pruned tensor {key!r} is not in {handle.name}: the base model changed")
        new = torch.empty(tuple(shape), dtype=old.dtype)
        if attr in owner._parameters:
            setattr(owner, attr, torch.nn.Parameter(new, requires_grad=old.requires_grad))
        else:
            owner._buffers[attr] = new
    for name, vals in record.meta.get("attrs", {}).items():
        owner = module.get_submodule(name) if name else module
        for a, v in vals.items():
            setattr(owner, a, tuple(v) if isinstance(v, list) else v)
    cfg = _hf_config(module)
    for k, v in record.meta.get("hf_config", {}).items():
        if cfg is not None:
            setattr(cfg, k, v)
    return handle


# ----------------------------------------------------------------------------- the step


def apply(handle: ModelHandle, config: PruneConfig, ctx: StepContext | None) -> ModelHandle:
    """Prune ``handle`` in place, record shapes and MACs, and (with a target and the
    context's ``latency`` timer) measure the engine latency before and after."""
    import copy


    if handle.module is None:
        raise BadInputError(f"pruning needs a PyTorch model; {handle.name} is ONNX only")
    inputs = example_inputs(handle, 1)
    target = ctx.target if ctx is not None else None
    timed = target is not None and ctx is not None and ctx.latency is not None
    before_model = copy.deepcopy(handle.module) if timed else None
    macs_before = count_macs(handle.module, inputs)
    shapes0, attrs0 = _snapshot(handle.module)
    cfg = _hf_config(handle.module)
    hf0 = {k: getattr(cfg, k, None) for k in _HF_FIELDS} if cfg is not None else {}
    t0 = time.perf_counter()
    facts = prune_module(handle, config, ctx)
    seconds = time.perf_counter() - t0
    shapes1, attrs1 = _snapshot(handle.module)
    hf1 = {k: getattr(cfg, k, None) for k in _HF_FIELDS} if cfg is not None else {}
    macs_after = count_macs(handle.module, inputs)
    layers = {}
    for name, b in macs_before["layers"].items():
        a = macs_after["layers"].get(name, {"macs": 0, "params": 0})
        if a != b:
            layers[name] = {"macs_before": b["macs"], "macs_after": a["macs"],
                            "params_before": b["params"], "params_after": a["params"]}
    summary = {
        "macs_before": macs_before["macs"], "macs_after": macs_after["macs"],
        "params_before": macs_before["params"], "params_after": macs_after["params"],
        "mac_ratio": round(macs_before["macs"] / max(macs_after["macs"], 1), 4),
        "param_ratio": round(macs_before["params"] / max(macs_after["params"], 1), 4),
        "seconds": round(seconds, 3),
    }
    if target is not None and before_model is not None and ctx is not None and ctx.latency is not None:
        before = ModelHandle(**{**handle.__dict__, "module": before_model, "steps": []})
        lat_b = ctx.latency(before, target)
        lat_a = ctx.latency(handle, target)
        summary.update({"latency_before_ms": round(lat_b["p50_ms"], 4), "latency_after_ms": round(lat_a["p50_ms"], 4),
                        "speedup": round(lat_b["p50_ms"] / max(lat_a["p50_ms"], 1e-9), 3)})
    meta = {**facts, **summary, "layers": layers, "shapes": _diff_shapes(shapes0, shapes1),
            "attrs": _diff_attrs(attrs0, attrs1),
            "hf_config": {k: v for k, v in hf1.items() if hf0.get(k) != v}}
    handle.steps.append(StepRecord("prune", config_to_dict(config), meta))
    handle.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    if ctx is not None:
        ctx.metrics["prune"] = summary
    handle.extra["params"] = macs_after["params"]
    return handle


def _make_step() -> Any:

    return Step("prune", PruneConfig, apply,
                "structured channel/head pruning with Torch-Pruning's dependency graph",
                rebuild=rebuild, transitions={"float": "float"}, deliberate=True,
                unchanged_at={"ratio": 0})  # ratio 0 prunes nothing: a sweep's unpruned baseline


STEP = _make_step()
