"""Causal LMs exported with their KV cache: the names and metadata an exported graph carries
(``export`` writes them, the ONNX Runtime engine reads them) and ``KVCacheDecoder``, the
prefill and one-token decode loop through ONNX Runtime's IO binding that export's parity check
and the engine's generation profile share.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edgekit.errors import BadInputError
from edgekit.limits import require_memory
from edgekit.onnx_checks import ort_module

# Metadata a graph carries when its attention appends to the KV cache in place: a past buffer of
# the maximum length bound to the same memory as the present output (GroupQueryAttention's
# shared-buffer mode). Graphs without it return a present one token longer than the past.
KV_CACHE_METADATA = "edgekit.kv_cache"
KV_SHARED_BUFFER = "shared-buffer"
PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."


def is_causal_lm_session(session: Any) -> bool:
    """Whether an ONNX Runtime session is a causal LM exported with its KV cache."""
    return any(i.name.startswith(PAST_PREFIX) for i in session.get_inputs())


class KVCacheDecoder:
    """Prefill and one-token decode steps of a with-past causal-LM session through IO binding.

    The KV cache never passes through numpy. With a shared-buffer graph (``KV_CACHE_METADATA``),
    each layer's past and present are one preallocated ``(batch, kv_heads, max_length, head_dim)``
    buffer, bound as both input and output, so attention appends the new token in place; other
    graphs (the traced export, which concatenates) get their presents bound as the next step's
    pasts as ONNX Runtime values, without a copy out.

    >>> dec = KVCacheDecoder(session, max_length=256)  # doctest: +SKIP
    >>> tokens = dec.generate(prompt_ids, new_tokens=32)  # doctest: +SKIP
    """

    def __init__(self, session: Any, max_length: int, batch: int = 1) -> None:
        ort = ort_module()
        if not is_causal_lm_session(session):
            raise BadInputError("the session has no past_key_values inputs: not a causal LM exported with its KV cache")
        if max_length < 2 or batch < 1:
            raise BadInputError(f"max_length must be >= 2 and batch >= 1, got {max_length} and {batch}")
        self.session = session
        self.max_length = int(max_length)
        self.batch = int(batch)
        meta = session.get_modelmeta().custom_metadata_map or {}
        self.shared = meta.get(KV_CACHE_METADATA) == KV_SHARED_BUFFER
        self.input_names = {i.name for i in session.get_inputs()}
        self.pasts = [i for i in session.get_inputs() if i.name.startswith(PAST_PREFIX)]
        self.dtype = np.float16 if "float16" in self.pasts[0].type else np.float32
        self.logits_name = session.get_outputs()[0].name
        self.binding = session.io_binding()
        self.cache: dict[str, Any] = {}
        if self.shared:
            for spec in self.pasts:
                heads, dim = spec.shape[1], spec.shape[3]
                if not (isinstance(heads, int) and isinstance(dim, int)):
                    raise BadInputError(f"KV-cache input {spec.name} has no static head dimensions: {spec.shape}")
            itemsize = np.dtype(self.dtype).itemsize
            require_memory(sum(self.batch * s.shape[1] * self.max_length * s.shape[3] * itemsize for s in self.pasts),
                           f"the KV cache of {self.max_length} tokens at batch {self.batch}",
                           "lower --contexts, --prompt-lengths or --new-tokens")
            for spec in self.pasts:
                heads, dim = spec.shape[1], spec.shape[3]
                self.cache[spec.name] = ort.OrtValue.ortvalue_from_shape_and_type(
                    [self.batch, heads, self.max_length, dim], self.dtype, "cpu", 0)
        self.length = 0  # tokens in the cache

    @property
    def vocab_size(self) -> int:
        """The logits' last dimension where it is static, else 32,000 (a common vocabulary)."""
        dim = self.session.get_outputs()[0].shape[-1]
        return int(dim) if isinstance(dim, int) and dim > 0 else 32_000

    def kv_cache_bytes(self, length: int) -> int:
        """Bytes of the KV cache holding ``length`` tokens: every layer's key and value buffers."""
        return sum(int(np.prod([self.batch, s.shape[1], length, s.shape[3]])) * np.dtype(self.dtype).itemsize
                   for s in self.pasts)

    def reset(self) -> None:
        """Forget the cached tokens (the shared buffers are reused as they are)."""
        self.length = 0
        if not self.shared:
            self.cache = {}

    def _bind(self, input_ids: np.ndarray) -> None:
        ort = ort_module()
        b, t = input_ids.shape
        if b != self.batch:
            raise BadInputError(f"batch {b} differs from the decoder's batch {self.batch}")
        total = self.length + t
        if total > self.max_length:
            raise BadInputError(f"{total} tokens exceed the KV cache of {self.max_length} tokens")
        io = self.binding
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        io.bind_output(self.logits_name, "cpu")  # outputs come back in binding order: logits first
        io.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        if "attention_mask" in self.input_names:
            io.bind_cpu_input("attention_mask", np.ones((b, total), dtype=np.int64))
        if "position_ids" in self.input_names:
            io.bind_cpu_input("position_ids", np.broadcast_to(np.arange(self.length, total, dtype=np.int64),
                                                              (b, t)).copy())
        for spec in self.pasts:
            present = PRESENT_PREFIX + spec.name[len(PAST_PREFIX):]
            if self.shared:
                io.bind_ortvalue_input(spec.name, self.cache[spec.name])
                io.bind_ortvalue_output(present, self.cache[spec.name])
                continue
            past = self.cache.get(spec.name)
            if past is None:
                past = ort.OrtValue.ortvalue_from_numpy(
                    np.zeros((b, spec.shape[1], 0, spec.shape[3]), dtype=self.dtype))
            io.bind_ortvalue_input(spec.name, past)
            io.bind_output(present, "cpu")

    def forward(self, input_ids: np.ndarray) -> np.ndarray:
        """Run ``input_ids`` (batch, tokens) after the cached tokens; logits (batch, tokens, vocab)."""
        self._bind(input_ids)
        self.session.run_with_iobinding(self.binding)
        outputs = self.binding.get_outputs()
        if not self.shared:  # the presents, bound in the order of the pasts
            for spec, value in zip(self.pasts, outputs[1:], strict=True):
                self.cache[spec.name] = value
        self.length += int(input_ids.shape[1])
        return outputs[0].numpy()

    def generate(self, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
        """Greedy decoding: the ``new_tokens`` token ids (batch, new_tokens) after ``prompt``."""
        self.reset()
        logits = self.forward(prompt)
        tokens = [logits[:, -1].argmax(-1)]
        for _ in range(new_tokens - 1):
            logits = self.forward(tokens[-1][:, None].astype(np.int64))
            tokens.append(logits[:, -1].argmax(-1))
        return np.stack(tokens, axis=1)
