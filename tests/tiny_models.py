"""Tiny random-weight models of the architectures users bring, built offline from
transformers configs and saved as local Hugging Face folders, so tests go through
edgekit's normal loader (``load_model(folder)``) as a user's download would.

Every decoder is hidden 64, 2 layers, a byte-level tokenizer of 256 bytes + 4 special
tokens (vocabulary 260), seeded weights. The weights are scaled up from transformers'
init (std 0.02 would give near-uniform logits, against which every quantization error
looks tiny) so that a dropped scale or a wrong norm shows in the logits.

>>> folder = save_tiny("llama", tmp_path)  # doctest: +SKIP
>>> load_model(folder).kind  # doctest: +SKIP
'causal-lm'
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN = 64
LAYERS = 2
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
VOCAB = 256 + len(SPECIALS)
INIT_STD = 0.08  # transformers' default 0.02 makes logits near-uniform (see the module docstring)


def _common(**over: Any) -> dict[str, Any]:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                pad_token_id=256, bos_token_id=257, eos_token_id=258, initializer_range=INIT_STD)
    base.update(over)
    return base


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(**_common(tie_word_embeddings=True))


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(**_common(tie_word_embeddings=False, sliding_window=64))


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(**_common(tie_word_embeddings=True))  # q/k/v biases


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**_common(tie_word_embeddings=True, head_dim=16))  # q/k norms


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM, Gemma2Config(**_common(head_dim=16, sliding_window=64, query_pre_attn_scalar=16,
                                                    hidden_activation="gelu_pytorch_tanh"))


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM, Gemma3TextConfig(**_common(head_dim=16, sliding_window=64, query_pre_attn_scalar=16,
                                                        sliding_window_pattern=2, layer_types=None))


def _phi3() -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM, Phi3Config(**_common(tie_word_embeddings=False))  # fused qkv and gate_up


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128,
                                       bos_token_id=257, eos_token_id=258, initializer_range=INIT_STD,
                                       architectures=["GPT2LMHeadModel"])  # Conv1D layers


def _opt() -> Any:
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM, OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=HIDDEN,
                                     pad_token_id=256, bos_token_id=257, eos_token_id=258, init_std=INIT_STD)


def _gpt_neox() -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM, GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                             num_hidden_layers=LAYERS, num_attention_heads=4,
                                             max_position_embeddings=128, rotary_pct=0.5, bos_token_id=257,
                                             eos_token_id=258, initializer_range=INIT_STD, tie_word_embeddings=False)


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    # 4 experts, top-2: each expert sees its own subset of the tokens
    return MixtralForCausalLM, MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2,
                                                       tie_word_embeddings=False))


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # routed experts plus a gated shared expert
    return Qwen2MoeForCausalLM, Qwen2MoeConfig(**_common(num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=HIDDEN,
                                                         shared_expert_intermediate_size=2 * HIDDEN,
                                                         tie_word_embeddings=False))


def _falcon() -> Any:
    from transformers import FalconConfig, FalconForCausalLM

    # Falcon-40B/180B style: new decoder architecture, grouped KV, parallel attention and MLP
    return FalconForCausalLM, FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                           num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                           max_position_embeddings=128, bos_token_id=257, eos_token_id=258,
                                           initializer_range=INIT_STD)


def _llama4() -> Any:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    # Llama 4 text: MoE with a shared expert in every layer, chunked attention, no-rope layers
    return Llama4ForCausalLM, Llama4TextConfig(**_common(head_dim=16, intermediate_size_mlp=2 * HIDDEN,
                                                         num_local_experts=4, num_experts_per_tok=1,
                                                         attention_chunk_size=64, tie_word_embeddings=False))


def _bert() -> Any:
    from transformers import BertConfig, BertModel

    return BertModel, BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                 num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=128,
                                 pad_token_id=256, initializer_range=INIT_STD)


DECODERS: dict[str, Callable[[], Any]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3,
    "phi3": _phi3, "gpt2": _gpt2, "opt": _opt, "gpt-neox": _gpt_neox,
}
# decoders the matrix meets with their own expectations (mixture of experts, Falcon's fused q/k/v)
MORE_DECODERS: dict[str, Callable[[], Any]] = {
    "mixtral": _mixtral, "qwen2-moe": _qwen2_moe, "falcon": _falcon, "llama4": _llama4,
}
ENCODERS: dict[str, Callable[[], Any]] = {"bert": _bert}
GEMMA = ("gemma2", "gemma3")  # their tokenizers add <bos>; their embeddings are scaled by sqrt(hidden)

# Rotary scaling of every type transformers defines (transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS), as
# config overrides of a decoder with head_dim 16: pretrained for ORIGINAL_CONTEXT positions, scaled 4x. Longrope's
# short and long factors differ enough that taking one for the other shows in the logits.
ORIGINAL_CONTEXT = 64
_LONGROPE = {"short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}
ROPE_SCALING: dict[str, dict[str, Any]] = {
    "default": {"max_position_embeddings": 4 * ORIGINAL_CONTEXT},
    "linear": {"max_position_embeddings": ORIGINAL_CONTEXT, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "dynamic": {"max_position_embeddings": ORIGINAL_CONTEXT, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    "yarn": {"max_position_embeddings": 4 * ORIGINAL_CONTEXT,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}},
    "longrope": {"max_position_embeddings": 4 * ORIGINAL_CONTEXT, "original_max_position_embeddings": ORIGINAL_CONTEXT,
                 "rope_scaling": {"type": "longrope", **_LONGROPE}},  # Phi3Config wants exactly these keys
    "llama3": {"max_position_embeddings": 4 * ORIGINAL_CONTEXT,
               "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": ORIGINAL_CONTEXT}},
}


def byte_tokenizer(add_bos: bool = False) -> Any:
    """A byte-level BPE tokenizer without merges: ids 0-255 are bytes, 256-259 the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab.update({s: 256 + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", 257)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", model_max_length=128)


def build(family: str, seed: int = 0, vary_norms: bool = False, **config: Any) -> Any:
    """The float transformers model of ``family`` with seeded random weights (eval mode);
    ``config`` overrides fields of its config (``sliding_window=8``). ``vary_norms``: LayerNorm
    weights and biases drawn around their init (weight 1, bias 0: the identity, under which a norm
    read from the wrong module or a dropped bias does not show in the logits)."""
    import torch

    cls, cfg = {**DECODERS, **MORE_DECODERS, **ENCODERS}[family]()
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if family in GEMMA:  # Gemma's RMSNorm multiplies by (1 + w): make w matter (it is zero at init)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.2)
    if vary_norms:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.normal_(1.0, 0.2)
                    if m.bias is not None:
                        m.bias.normal_(0.0, 0.2)
    return model


def save_tiny(family: str, root: Path, seed: int = 0, vary_norms: bool = False, **config: Any) -> Path:
    """``family`` saved as a Hugging Face folder (config, safetensors, tokenizer) under ``root``."""
    folder = Path(root) / family
    model = build(family, seed, vary_norms, **config)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer(add_bos=family in GEMMA).save_pretrained(folder)
    return folder


# --- vision: the families edgekit's zoo carries, through the "pkg.mod:factory" entry point ----------


def tiny_effnet() -> Any:
    """EfficientNet-Lite-shaped (depthwise separable blocks, ReLU6, no squeeze-excite): a
    ModelHandle through edgekit's entry-point loader (``tests.tiny_models:tiny_effnet``)."""
    import torch
    from torch import nn

    from edgekit.sources.handle import InputSpec, ModelHandle

    def block(cin: int, cout: int, stride: int, expand: int = 4) -> nn.Module:
        mid = cin * expand
        return nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                             nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                             nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                           block(16, 24, 2), block(24, 32, 2), nn.Conv2d(32, 64, 1), nn.ReLU6(),
                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()
    with torch.no_grad():  # running statistics away from the identity, so folding them matters
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return {"input": np.random.default_rng(batch).uniform(-1, 1, (batch, 3, 224, 224)).astype(np.float32)}

    return ModelHandle(name="tiny-effnet", source="tests.tiny_models:tiny_effnet", kind="image-classifier",
                       module=module, inputs=[InputSpec("input", ("batch", 3, 224, 224), "float32")],
                       outputs=["logits"], make_inputs=make_inputs, evaluator="agreement",
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, extra={"num_classes": 10})


# --- the generated matrix: every causal LM class of the installed transformers ---------------------

# The size fields transformers' configs use (each config takes those it knows): what makes a config tiny.
TINY_FIELDS: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    initializer_range=INIT_STD, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128, n_inner=2 * HIDDEN,
    d_model=HIDDEN, ffn_dim=2 * HIDDEN, moe_intermediate_size=HIDDEN, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, pad_token_id=256, bos_token_id=257, eos_token_id=258)
TINY_PARAMS = 2_000_000  # a config that stays larger than this with the fields above is not "tiny"


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a ``*ForCausalLM`` class (generated, not
    hand-picked): the rows of the decoder conformance matrix."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_causal_lm(model_type: str, seed: int = 0) -> Any:
    """The ``*ForCausalLM`` of ``model_type`` built from its config with ``TINY_FIELDS`` (those it
    takes), seeded random weights, eval mode; a string saying why instead when the config cannot be
    made tiny (it fails to build, or stays over ``TINY_PARAMS`` parameters)."""
    import inspect
    import warnings

    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    if cls is None:
        return f"{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]} is not importable here"
    config_cls = CONFIG_MAPPING[model_type]
    taken = inspect.signature(config_cls.__init__).parameters
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = config_cls(**{k: v for k, v in TINY_FIELDS.items() if k in taken})
            torch.manual_seed(seed)
            model = cls(config).eval()
    except Exception as e:  # a config whose other defaults do not fit the tiny sizes
        return f"its config does not build at tiny sizes ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    n = sum(p.numel() for p in model.parameters())
    if n > TINY_PARAMS:
        return f"{n / 1e6:.1f}M parameters at the tiny sizes (fields it does not take keep it large)"
    try:  # state-space models without their kernels ask for absurd buffers here, and fail at once
        with torch.no_grad():
            model(torch.arange(128).reshape(4, 32))  # the matrix's window shape
    except Exception as e:
        return f"the float model does not run at tiny sizes ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return model
