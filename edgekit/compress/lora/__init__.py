"""LoRA and QLoRA: low-rank adapters trained over a frozen base, merged or folded for deployment.

Three bases, one step (``"lora"``):

* **float** (``qlora=False``): peft's LoRA layers are injected in place into ``nn.Linear`` /
  ``nn.Conv2d`` modules (CNNs) or the q/k/v/o/gate/up/down projections (transformers).
  ``merge=True`` (the default) folds ``W + (alpha/r) B A`` into the float weights and
  removes the adapters, so the next step of the chain (``weight-only`` or ``int8``) re-quantizes it.
* **packed** (``qlora=True, qlora_base="packed"``, the default QLoRA): edgekit's own 4-bit
  model (``compress --bits 4``), adapters in ``LoraQuantLinear`` over the frozen packed
  weights (``packed.py``). ``merge=False`` (the default here) keeps the adapters beside the
  base: the export is ``MatMulNBits`` plus two small MatMuls per layer, exact.
* **nf4** (``qlora=True, qlora_base="nf4"``): bitsandbytes NF4 as the QLoRA paper does it
  (``nf4.py``); always ends merged into float weights.

Where things are: ``config.py`` (``LoraConfig``), ``targets.py`` (which modules to adapt),
``packed.py`` (the adapter layer and the memory-saving autograd over packed weights),
``nf4.py`` (bitsandbytes), ``adapters.py`` (inject, save, load, merge), ``train.py``
(LoRA's batches, loss and schedule, run by ``edgekit.training.fit``) and ``step.py`` (the
step). The validation loss is ``edgekit.evaluate.evaluate_loss``; the user-facing API is
``edgekit.finetune.finetune``.

The names below are imported on first use: ``config.py`` (``LoraConfig``) is read by the
command line to build the options of ``edgekit finetune`` without PyTorch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgekit.compress.lora.adapters import adapter_state as adapter_state
    from edgekit.compress.lora.adapters import inject as inject
    from edgekit.compress.lora.adapters import is_adapter_key as is_adapter_key
    from edgekit.compress.lora.adapters import load_adapter as load_adapter
    from edgekit.compress.lora.adapters import lora_layers as lora_layers
    from edgekit.compress.lora.adapters import merge_adapters as merge_adapters
    from edgekit.compress.lora.adapters import trainable_parameters as trainable_parameters
    from edgekit.compress.lora.config import QLORA_BASES as QLORA_BASES
    from edgekit.compress.lora.config import LoraConfig as LoraConfig
    from edgekit.compress.lora.nf4 import to_nf4 as to_nf4
    from edgekit.compress.lora.packed import LoraQuantLinear as LoraQuantLinear
    from edgekit.compress.lora.packed import frozen_packed_forwards as frozen_packed_forwards
    from edgekit.compress.lora.packed import repack as repack
    from edgekit.compress.lora.step import STEP as STEP
    from edgekit.compress.lora.step import LoadedData as LoadedData
    from edgekit.compress.lora.step import apply as apply
    from edgekit.compress.lora.step import rebuild as rebuild
    from edgekit.compress.lora.targets import TRANSFORMER_TARGETS as TRANSFORMER_TARGETS
    from edgekit.compress.lora.targets import candidate_modules as candidate_modules
    from edgekit.compress.lora.targets import resolve_targets as resolve_targets
    from edgekit.compress.lora.train import CHECKPOINT_DIR as CHECKPOINT_DIR
    from edgekit.compress.lora.train import train_adapters as train_adapters

_NAMES = {"adapter_state": "adapters", "inject": "adapters", "is_adapter_key": "adapters", "load_adapter": "adapters", "lora_layers": "adapters", "merge_adapters": "adapters", "trainable_parameters": "adapters", "QLORA_BASES": "config", "LoraConfig": "config", "to_nf4": "nf4", "LoraQuantLinear": "packed", "frozen_packed_forwards": "packed", "repack": "packed", "STEP": "step", "LoadedData": "step", "apply": "step", "rebuild": "step", "TRANSFORMER_TARGETS": "targets", "candidate_modules": "targets", "resolve_targets": "targets", "CHECKPOINT_DIR": "train", "train_adapters": "train"}

__all__ = ["CHECKPOINT_DIR", "QLORA_BASES", "STEP", "TRANSFORMER_TARGETS", "LoadedData", "LoraConfig",
           "LoraQuantLinear", "adapter_state", "apply", "candidate_modules", "frozen_packed_forwards", "inject",
           "is_adapter_key", "load_adapter", "lora_layers", "merge_adapters", "rebuild", "repack",
           "resolve_targets", "to_nf4", "train_adapters", "trainable_parameters"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"edgekit.compress.lora.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'edgekit.compress.lora' has no attribute {name!r}")
