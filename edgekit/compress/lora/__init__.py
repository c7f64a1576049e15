"""LoRA and QLoRA: low-rank adapters trained over a frozen base, merged or folded for deployment.

Three bases, one step (``"lora"``):

* **float** (``qlora=False``): peft's LoRA layers are injected in place into ``nn.Linear`` /
  ``nn.Conv2d`` modules (CNNs) or the q/k/v/o/gate/up/down projections (transformers).
  ``merge=True`` (the default) folds ``W + (alpha/r) B A`` into the float weights and
  removes the adapters, so the next step of the chain (``int4`` or ``int8``) re-quantizes it.
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
"""
from edgekit.compress.lora.adapters import (
    adapter_state,
    inject,
    is_adapter_key,
    load_adapter,
    lora_layers,
    merge_adapters,
    trainable_parameters,
)
from edgekit.compress.lora.config import QLORA_BASES, LoraConfig
from edgekit.compress.lora.nf4 import to_nf4
from edgekit.compress.lora.packed import LoraQuantLinear, frozen_packed_forwards, repack
from edgekit.compress.lora.step import STEP, LoadedData, apply, rebuild
from edgekit.compress.lora.targets import TRANSFORMER_TARGETS, candidate_modules, resolve_targets
from edgekit.compress.lora.train import CHECKPOINT_DIR, train_adapters

__all__ = ["CHECKPOINT_DIR", "QLORA_BASES", "STEP", "TRANSFORMER_TARGETS", "LoadedData", "LoraConfig",
           "LoraQuantLinear", "adapter_state", "apply", "candidate_modules", "frozen_packed_forwards", "inject",
           "is_adapter_key", "load_adapter", "lora_layers", "merge_adapters", "rebuild", "repack",
           "resolve_targets", "to_nf4", "train_adapters", "trainable_parameters"]
