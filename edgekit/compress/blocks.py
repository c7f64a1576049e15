"""The block walk shared by the weight-only algorithms (GPTQ, AWQ): the model's repeated blocks
and their linear layers, and the calibration activations flowing through them.

``BlockWalker.walk(linears, visit_group)`` captures the inputs of block 0 once for all
calibration windows; then, for each block, visits its linear layers in execution order,
grouped by shared input (q/k/v, o, gate/up, down for a Llama block), each group seeing inputs
produced by the already-quantized groups before it (``GroupInputs``: the forward stops right
after the group's input is seen); finally it re-runs the quantized block to produce the next
block's inputs. Memory holds one block's activations for all windows, never the whole model's.
The algorithms plug in as the ``visit_group`` callback (``gptq.gptq_visit``, ``awq.awq_visit``);
this module knows none of them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from edgekit.compress.families import family_of, hf_model
from edgekit.errors import BadInputError
from edgekit.progress import progress_bar

Quantized = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # name -> (q, scales, zeros)
# one batch of a block's inputs: its positional arguments (hidden states first) and keyword arguments
Batch = tuple[tuple[Any, ...], dict[str, Any]]


class ValueProjection(NamedTuple):
    """An attention's value projection, for GPTQ's attention-mixed Hessian (``value_projection``)."""

    name: str  # the projection's path in the model
    attn: nn.Module  # the attention module around it
    rep: int  # query heads per key/value head
    head_dim: int


# --- finding the layers -------------------------------------------------------------------------


def submodule(module: nn.Module, name: str) -> nn.Module:
    """``module``'s submodule ``name`` (the module itself for "")."""
    return module.get_submodule(name) if name else module


def linear_at(module: nn.Module, name: str) -> nn.Linear:
    """The ``nn.Linear`` at ``name`` inside ``module`` (TypeError for anything else)."""
    m = submodule(module, name)
    if not isinstance(m, nn.Linear):
        raise TypeError(f"{name!r} is a {type(m).__name__}, not nn.Linear")
    return m


def replace_module(module: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``name`` is inside ``module``."""
    parent, _, child = name.rpartition(".")
    setattr(submodule(module, parent), child, new)


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """The repeated blocks to walk: the ``nn.ModuleList`` holding the most linear layers
    (a transformer's layers); else the whole model as one block. Returns (prefix, blocks)."""
    best, best_n = None, 0
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(isinstance(x, nn.Linear) for x in m.modules())
            if n > best_n:
                best, best_n = name, n
    if best is None:
        return "", [module]
    found = submodule(module, best)
    if not isinstance(found, nn.ModuleList):  # found among the ModuleLists above
        raise RuntimeError(f"{best} is no longer a ModuleList")
    return best, list(found)


def check_blocks(module: nn.Module, prefix: str, blocks: list[nn.Module]) -> None:
    """The walked blocks must be the model's layers as its config counts them (a Hugging Face model);
    anything else is a structure the walk would only guess at."""
    hf = hf_model(module)
    n = getattr(getattr(hf, "config", None), "num_hidden_layers", None)
    if isinstance(n, int) and prefix and len(blocks) != n:
        raise BadInputError(f"the block walk found {len(blocks)} blocks in {prefix!r}, but the model's config declares "
                            f"{n} layers; edgekit does not know this model's structure")


def head_layers(module: nn.Module) -> tuple[str | None, str | None]:
    """(LM head name, input embedding name) of a Hugging Face causal LM inside ``module``."""
    for _name, m in module.named_modules():
        if hasattr(m, "get_output_embeddings") and hasattr(m, "get_input_embeddings"):
            try:
                out, inp = m.get_output_embeddings(), m.get_input_embeddings()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(out, nn.Linear):
                names = {id(x): n for n, x in module.named_modules()}
                return names.get(id(out)), names.get(id(inp)) if isinstance(inp, nn.Embedding) else None
    return None, None


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # config fields naming the experts


def expert_routers(module: nn.Module) -> list[str]:
    """The routers of a mixture-of-experts model: linears named ``gate``/``router`` whose outputs
    are one score per expert (``config.num_local_experts`` and its synonyms). They stay in float:
    their few weights decide which experts run, and a 4-bit router changes the routing itself."""
    cfg = getattr(hf_model(module), "config", None)
    counts = {getattr(cfg, k, None) for k in EXPERT_COUNTS} - {None}
    counts = {c for c in counts if isinstance(c, int) and c > 1}
    if not counts:
        return []
    return [n for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and m.out_features in counts and n.rpartition(".")[2] in ("gate", "router")]


def quantizable_linears(module: nn.Module) -> tuple[str, list[nn.Module], dict[str, nn.Linear]]:
    """(block prefix, blocks, name -> nn.Linear) of the linears inside the blocks, the LM head and
    mixture-of-experts routers (``expert_routers``) left out."""
    prefix, blocks = find_blocks(module)
    head, _ = head_layers(module)
    skip = {head, *expert_routers(module)}
    names = {id(m): n for n, m in module.named_modules()}
    linears: dict[str, nn.Linear] = {}
    for b in blocks:
        for m in b.modules():
            if isinstance(m, nn.Linear) and names[id(m)] not in skip:
                linears[names[id(m)]] = m
    return prefix, blocks, linears



class _Stop(Exception):
    pass


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class BlockWalker:
    """Runs the calibration set through the model one block at a time.

    ``walk(visit_group)`` calls ``visit_group(block_index, names, inputs)`` for each group of
    linears sharing one input, in execution order; ``inputs`` (a ``GroupInputs``) is an
    iterator factory yielding that group's input activations batch by batch (computed on
    demand through the block's already-quantized layers). ``visit_group`` quantizes the group in place (float
    weights on the quantized grid) before the walk moves on.
    """

    def __init__(self, module: nn.Module, calib: list[torch.Tensor], device: str = "cpu",
                 batch_size: int = 8, progress: bool = True, track_float: bool = False) -> None:
        self.module = module
        self.calib = calib
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.progress = progress
        # also carry the float model's activations: one forward of each block before it is quantized
        # keeps every group's float inputs (one block's worth of activations) for GroupInputs.paired()
        self.track_float = track_float
        self.prefix, self.blocks = find_blocks(module)
        self.names = {id(m): n for n, m in module.named_modules()}

    def _capture_block0(self) -> list[Batch]:
        if not self.prefix:  # the whole model is the block: its inputs are the samples
            n = self.calib[0].shape[0]
            return [(tuple(t[i:i + self.batch_size].to(self.device) for t in self.calib), {})
                    for i in range(0, n, self.batch_size)]
        captured: list[Batch] = []

        def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kw = dict(kwargs)
            for cache in ("past_key_values", "past_key_value", "layer_past"):  # GPT-NeoX: layer_past
                if cache in kw:
                    kw[cache] = None
            if "use_cache" in kw:
                kw["use_cache"] = False
            # a KV cache passed positionally (GPT-2's blocks take it as their 2nd argument): none
            args = tuple(None if hasattr(a, "get_seq_length") else a for a in args)
            captured.append((tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kw))
            raise _Stop

        h = self.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            n = self.calib[0].shape[0]
            for i in range(0, n, self.batch_size):
                try:
                    self.module(*[t[i:i + self.batch_size].to(self.device) for t in self.calib])
                except _Stop:
                    pass
        finally:
            h.remove()
        return captured

    def _input_groups(self, block: nn.Module, batch: Batch) -> list[list[str]]:
        """Linears of ``block`` in execution order, grouped by identical input tensor."""
        order: list[tuple[str, torch.Tensor]] = []
        hooks: list[RemovableHandle] = []
        for m in block.modules():
            if isinstance(m, nn.Linear) and self.names[id(m)] in self.linears:
                name = self.names[id(m)]
                hooks.append(m.register_forward_pre_hook(
                    lambda _m, args, name=name: order.append((name, args[0]))))
        try:
            # the whole first batch, as captured: slicing to one sample would have to know every block's
            # own state arguments (RWKV, recurrent Gemma, XLNet), and more samples reach more experts
            args, kw = batch
            block(*args, **kw)
        finally:
            for h in hooks:
                h.remove()
        groups: list[list[str]] = []
        last: torch.Tensor | None = None
        for name, x in order:  # tensors kept alive here, so identity is reliable
            if any(name in g for g in groups):
                continue
            if groups and x is last:
                groups[-1].append(name)
            else:
                groups.append([name])
            last = x
        # experts the probe sample was not routed to: one group each, in module order (their inputs
        # come from whatever calibration tokens the router sends them, possibly none)
        seen = {n for g in groups for n in g}
        groups += [[self.names[id(m)]] for m in block.modules()
                   if isinstance(m, nn.Linear) and self.names[id(m)] in self.linears and self.names[id(m)] not in seen]
        return groups

    @torch.no_grad()
    def walk(self, linears: dict[str, nn.Linear], visit_group: GroupVisit) -> None:
        self.linears = linears
        data = self._capture_block0()
        data_fp: list[Batch] | None = data if self.track_float else None  # the blocks before the first are not quantized
        for bi in progress_bar(range(len(self.blocks)), "quantize blocks", enabled=self.progress):
            block = self.blocks[bi]
            if any(isinstance(m, nn.Linear) and self.names[id(m)] in linears for m in block.modules()):
                groups = self._input_groups(block, data[0])
                float_inputs: dict[str, list[torch.Tensor | None]] = {}
                # linears left in float (routers): where a routed expert's tokens come from
                kept = [self.names[id(m)] for m in block.modules()
                        if isinstance(m, nn.Linear) and self.names[id(m)] not in linears]
                if data_fp is not None:
                    # The float block never changes, so one forward gives every group's float
                    # inputs (and the next block's float input) before this block is touched.
                    data_fp, float_inputs = self._run_capturing(block, data_fp, [g[0] for g in groups] + kept)
                for names in groups:
                    inputs = GroupInputs(block, submodule(self.module, names[0]), data)
                    if data_fp is not None:
                        inputs.float_inputs = float_inputs[names[0]]
                        inputs.float_layers = {submodule(self.module, n): x for n, x in float_inputs.items()}
                        inputs.expert_layers = _siblings(self.module, names[0])
                    visit_group(bi, names, inputs)
            elif data_fp is not None:
                data_fp = [_with_hidden(b, self._run(block, b)) for b in data_fp]
            data = [_with_hidden(b, self._run(block, b)) for b in data]

    def _run(self, block: nn.Module, batch: Batch) -> torch.Tensor:
        args, kw = batch
        return _first(block(*args, **kw)).detach()

    def _run_capturing(self, block: nn.Module, data: list[Batch],
                       names: list[str]) -> tuple[list[Batch], dict[str, list[torch.Tensor | None]]]:
        """``block`` over ``data``: its outputs as the next block's data, and the inputs of the
        named layers per batch (None for a batch that did not reach a layer: an expert the router
        did not choose)."""
        captured: dict[str, list[torch.Tensor | None]] = {n: [] for n in names}
        this: dict[str, torch.Tensor] = {}
        hooks = [submodule(self.module, n).register_forward_pre_hook(
            lambda _m, args, n=n: this.setdefault(n, args[0].detach())) for n in names]
        out: list[Batch] = []
        try:
            for b in data:
                this.clear()
                out.append(_with_hidden(b, self._run(block, b)))
                for n in names:
                    captured[n].append(this.get(n))
        finally:
            for h in hooks:
                h.remove()
        return out, captured


def _siblings(module: nn.Module, name: str) -> list[nn.Module]:
    """The linears sharing ``name``'s parent module (one expert's layers), ``name``'s own first."""
    parent = name.rpartition(".")[0]
    own = submodule(module, name)
    return [own] + [m for m in submodule(module, parent).children() if isinstance(m, nn.Linear) and m is not own]


GroupVisit = Callable[[int, list[str], "GroupInputs"], None]  # (block index, linear names, their inputs)


class GroupInputs:
    """The inputs of one group of linears, recomputed on demand from the block's inputs.

    ``inputs()`` yields the group's input activations batch by batch (the block's forward
    stops right at the group's first layer). ``attention_mixed(attn, v_proj)`` yields, per
    batch, the attention probabilities ``P`` (batch, heads, queries, keys) of ``attn`` and
    the inputs ``X`` (batch, keys, features) of its value projection: a value projection's
    output only matters through ``P @ (X Wᵀ)``, so its GPTQ objective uses ``P X``.
    """

    def __init__(self, block: nn.Module, first: nn.Module, data: list[Batch]) -> None:
        self.block, self.first, self.data = block, first, data
        # per batch, in the float model (track_float); None where the batch did not reach the layer
        self.float_inputs: list[torch.Tensor | None] | None = None
        # for routed groups (experts): every captured layer's float inputs, and the expert's own linears
        self.float_layers: dict[nn.Module, list[torch.Tensor | None]] = {}
        self.expert_layers: list[nn.Module] = [first]
        self.paired_rows = self.float_rows = 0  # routed groups: rows seen, rows with a float counterpart

    def __call__(self) -> Iterator[torch.Tensor]:
        return _group_inputs(self.block, self.first, self.data)

    @property
    def routed(self) -> bool:
        """Whether the group sees a subset of the block's tokens (a mixture-of-experts expert):
        its float inputs are not one row per token of every batch."""
        fp = self.float_inputs
        return fp is not None and any(
            x is None or x.shape[:-1] != _hidden(batch).shape[:-1] for x, batch in zip(fp, self.data))

    def paired(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, x_float)`` per batch: the group's input here and in the unquantized model
        (needs a walker with ``track_float``). For a routed group (an expert) the rows are the
        tokens the router sends it *here*; each is paired with the same token's input in the
        float model where the float model has one (the float router may have chosen other
        tokens), else with itself (the plain GPTQ objective for that token)."""
        if self.float_inputs is None:
            raise RuntimeError("paired inputs need BlockWalker(track_float=True)")
        if self.routed:
            return self._paired_by_token()
        return ((x, fp) for x, fp in zip(self(), self.float_inputs, strict=True) if fp is not None)

    def _tokens(self, seen: dict[nn.Module, torch.Tensor], b: int) -> torch.Tensor | None:
        """Token positions (in batch ``b``'s flattened tokens) of this expert's rows, from the layer
        inputs ``seen`` in one forward (the float model's or this one's): the expert's entry layer's
        rows are exact copies of rows of a full-token layer's input (the router's), found by match."""
        rows = seen.get(self.first)
        if rows is None:
            return None
        n = rows.reshape(-1, rows.shape[-1]).shape[0]
        tokens = _hidden(self.data[b]).shape[:-1].numel()
        for entry in self.expert_layers:
            x = seen.get(entry)
            if x is None or x.reshape(-1, x.shape[-1]).shape[0] != n:
                continue
            x = x.reshape(-1, x.shape[-1])
            for layer in self.float_layers:
                table = seen.get(layer)
                if layer in self.expert_layers or table is None or table.shape[-1] != x.shape[-1] \
                        or table.shape[:-1].numel() != tokens:  # one row per token
                    continue
                idx = row_positions(x, table.reshape(-1, table.shape[-1]))
                if idx is not None:
                    return idx
        return None

    def _paired_by_token(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        seen: dict[nn.Module, torch.Tensor] = {}
        watched = set(self.float_layers) | set(self.expert_layers)

        def record(m: nn.Module, args: tuple[Any, ...]) -> None:
            seen.setdefault(m, args[0].detach())
            if m is self.first:
                raise _Stop

        hooks = [m.register_forward_pre_hook(record) for m in watched]
        try:
            for b, (args, kw) in enumerate(self.data):
                seen.clear()
                try:
                    self.block(*args, **kw)
                except _Stop:
                    pass
                x = seen.get(self.first)
                if x is None:  # the router sent this expert no token of this batch
                    continue
                x = x.reshape(-1, x.shape[-1])
                x_fp = x.clone()
                fp = self.float_inputs[b] if self.float_inputs is not None else None
                if fp is not None:
                    here = self._tokens(seen, b)
                    float_seen = {m: t for m, v in self.float_layers.items() if (t := v[b]) is not None}
                    there = self._tokens(float_seen, b)
                    if here is not None and there is not None:
                        fp = fp.reshape(-1, x.shape[-1])
                        where = torch.full((_hidden(self.data[b]).shape[:-1].numel(),), -1, dtype=torch.long,
                                           device=x.device)
                        where[there] = torch.arange(there.shape[0], device=x.device)
                        match = where[here]
                        hit = match >= 0
                        x_fp[hit] = fp[match[hit]]
                        self.float_rows += int(hit.sum())
                self.paired_rows += x.shape[0]
                yield x, x_fp
        finally:
            for h in hooks:
                h.remove()

    def attention_mixed(self, attn: nn.Module, v_proj: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(P, X) per batch, with the attention run eagerly (the probabilities are its 2nd output)."""
        config: Any = attn.config  # a transformers PretrainedConfig
        saved = config._attn_implementation
        xs: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []

        def grab_x(_m: nn.Module, args: tuple[Any, ...]) -> None:
            xs.append(args[0].detach())

        def grab_p(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            probs.append(out[1].detach())
            raise _Stop

        hooks = [v_proj.register_forward_pre_hook(grab_x), attn.register_forward_hook(grab_p)]
        config._attn_implementation = "eager"
        try:
            for args, kw in self.data:
                xs.clear()
                probs.clear()
                kw = dict(kw)
                if kw.get("attention_mask") is None:  # sdpa ran causal without a mask; eager needs one
                    n = args[0].shape[1]
                    causal = torch.full((n, n), torch.finfo(args[0].dtype).min, device=args[0].device).triu(1)
                    kw["attention_mask"] = causal[None, None].expand(args[0].shape[0], 1, n, n)
                try:
                    self.block(*args, **kw)
                except _Stop:
                    pass
                if probs and probs[0] is not None and xs:
                    yield probs[0], xs[0]
        finally:
            config._attn_implementation = saved
            for h in hooks:
                h.remove()


def _hidden(batch: Batch) -> torch.Tensor:
    """The hidden states of a block's batch: its first positional argument, else its
    ``hidden_states`` keyword (blocks called with keywords only)."""
    args, kw = batch
    x = args[0] if args else kw.get("hidden_states")
    if not isinstance(x, torch.Tensor):
        raise BadInputError("the block walk cannot find the hidden states among the block's arguments")
    return x


def _with_hidden(batch: Batch, hidden: torch.Tensor) -> Batch:
    """``batch`` with ``hidden`` as its hidden states, where the block takes them (see ``_hidden``)."""
    args, kw = batch
    if args:
        return (hidden,) + tuple(args[1:]), kw
    return args, {**kw, "hidden_states": hidden}


def row_positions(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """For each row of ``rows`` (n, d), the index of an identical row of ``table`` (N, d) (exact
    equality: a gathered copy); None when some row is not in ``table``."""
    both = torch.cat([table, rows])
    _, inverse = torch.unique(both, dim=0, return_inverse=True)
    where = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long, device=rows.device)
    where[inverse[:table.shape[0]]] = torch.arange(table.shape[0], device=rows.device)
    idx = where[inverse[table.shape[0]:]]
    return None if bool((idx < 0).any()) else idx


def _group_inputs(block: nn.Module, first: nn.Module, data: list[Batch]) -> Iterator[torch.Tensor]:
    """Per batch of ``data``, the input of ``first``, running ``block`` only up to it."""
    box: list[torch.Tensor] = []

    def grab(_m: nn.Module, args: tuple[Any, ...]) -> None:
        box.append(args[0].detach())
        raise _Stop

    h = first.register_forward_pre_hook(grab)
    try:
        for args, kw in data:
            box.clear()
            try:
                block(*args, **kw)
            except _Stop:
                pass
            if box:
                yield box[0]
    finally:
        h.remove()


def value_projection(module: nn.Module, names: list[str]) -> ValueProjection | None:
    """(name, attention module, heads per key/value head, head dim) of the value projection
    among ``names``, for the families whose description names one (``families.py``: Llama,
    Gemma, ...: ``v_proj`` inside a module with ``head_dim``, ``num_key_value_groups`` and a
    config); None otherwise."""
    value = family_of(module).value_proj
    if value is None:
        return None
    for name in names:
        parent_name, _, child = name.rpartition(".")
        if not name.endswith("." + value) and name != value:
            continue
        attn = submodule(module, parent_name)
        groups, head_dim = getattr(attn, "num_key_value_groups", None), getattr(attn, "head_dim", None)
        if isinstance(groups, int) and isinstance(head_dim, int) and \
                hasattr(getattr(attn, "config", None), "_attn_implementation"):
            return ValueProjection(name, attn, groups, head_dim)
    return None


__all__ = ["EXPERT_COUNTS", "expert_routers", "row_positions", "Batch", "BlockWalker", "GroupInputs", "GroupVisit", "Quantized", "ValueProjection", "check_blocks",
           "find_blocks", "head_layers", "linear_at", "quantizable_linears", "replace_module", "submodule",
           "value_projection"]
