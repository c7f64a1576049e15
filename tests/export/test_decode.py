"""Fast causal-LM decoding: the fused decoder graph, the IO-bound KV-cache loop, generation metrics
and their gate, on a tiny random-weight Llama."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from edgekit.cli import cli
from edgekit.compress import StepContext
from edgekit.compress.weight_only.config import WeightOnlyConfig
from edgekit.compress.weight_only.step import apply
from edgekit.errors import BadInputError
from edgekit.export.lm import INT8_COMPUTE_RTOL, check_lm_parity, export_causal_lm, generate_greedy, lm_session
from edgekit.export.lm_graph import FusedGraphConfig, build_fused_decoder, supports_fused_graph
from edgekit.kv_cache import KVCacheDecoder
from edgekit.profiling import LatencyStats, ProfileResult
from edgekit.profiling_lm import GenerationConfig, check_generation, measure_generation
from edgekit.sources.handle import InputSpec, ModelHandle

VOCAB = 256


def tiny_llama(hidden_act: str = "silu") -> ModelHandle:
    """A 2-block Llama (GQA 4/2 heads, tied embeddings) with seeded random weights, scaled up so the
    greedy continuation varies from token to token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgekit.sources.hf import CausalLMWrapper

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=128, use_cache=False, hidden_act=hidden_act, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    module = CausalLMWrapper(model).eval()

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        ids = np.random.default_rng(1).integers(0, VOCAB, size=(batch, sequence or 16)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    seq = {0: "batch", 1: "sequence"}
    return ModelHandle(name="tiny-llama", source="tests.export.test_decode:tiny_llama", kind="causal-lm", module=module,
                       inputs=[InputSpec("input_ids", ("batch", "sequence"), "int64"),
                               InputSpec("attention_mask", ("batch", "sequence"), "int64")],
                       outputs=["logits"], make_inputs=make_inputs, default_calib=None,
                       dynamic_axes={"input_ids": seq, "attention_mask": seq, "logits": seq})


def _packed(group_size: int = 32) -> ModelHandle:
    return apply(tiny_llama(), WeightOnlyConfig(method="rtn", bits=4, group_size=group_size), StepContext(progress=False))


def _save(proto: onnx.ModelProto, tmp_path: Path, name: str = "model.onnx") -> Path:
    path = tmp_path / name
    onnx.save(proto, str(path))
    return path


def _torch_greedy(handle: ModelHandle, prompt: np.ndarray, n: int) -> list[int]:
    ids = torch.from_numpy(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(handle.module(ids, torch.ones_like(ids))[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


@pytest.mark.parametrize("group_size", [32, -1, None])  # None: the float model
def test_fused_graph_matches_pytorch_on_prefill_and_decode(tmp_path, group_size):
    h = tiny_llama() if group_size is None else _packed(group_size)
    proto = build_fused_decoder(h.module.model, FusedGraphConfig(accuracy_level=None))
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and ops.count("SkipSimplifiedLayerNormalization") == 4
    assert ops.count("MatMulNBits" if group_size is not None else "MatMul") == 9  # qkv, o, gate_up, down x 2 + head
    assert len(ops) < 45  # the traced graph of the same model has hundreds
    report = check_lm_parity(h, _save(proto, tmp_path), atol=1e-4, rtol=1e-4)
    assert report["passed"] and report["max_abs_diff"] < 1e-4 and report["argmax_agreement"] == 1.0
    assert report["io_binding"]["kv_cache"] == "in place (shared buffer)"
    assert report["io_binding"]["max_abs_diff_to_plain_loop"] < 1e-5


def test_fused_graph_with_int8_compute_stays_within_its_tolerance(tmp_path):
    h = _packed(32)
    path = _save(build_fused_decoder(h.module.model, FusedGraphConfig(accuracy_level=4, block_size=16)), tmp_path)
    report = check_lm_parity(h, path, atol=2e-3, rtol=INT8_COMPUTE_RTOL)
    assert report["passed"] and report["max_rel_diff"] < INT8_COMPUTE_RTOL
    blocks = {a.i for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "block_size"}
    assert blocks == {16}


def test_io_bound_decode_gives_the_tokens_of_the_plain_loop_and_of_pytorch(tmp_path):
    h = _packed(32)
    sess = lm_session(_save(build_fused_decoder(h.module.model, FusedGraphConfig(accuracy_level=None)), tmp_path))
    prompt = h.make_inputs(1, sequence=7)["input_ids"]
    plain = generate_greedy(sess, prompt, 12)
    decoder = KVCacheDecoder(sess, max_length=32)
    bound = decoder.generate(prompt, 12)[0]
    assert decoder.shared and decoder.length == 7 + 11
    assert bound.tolist() == plain.tolist() == _torch_greedy(h, prompt, 12)
    # teacher-forced steps over varied tokens: every step's logits equal the plain loop's and PyTorch's
    ids = h.make_inputs(1, sequence=20)["input_ids"]
    decoder.reset()
    steps = [decoder.forward(ids[:, :4])] + [decoder.forward(ids[:, t:t + 1]) for t in range(4, 20)]
    got = np.concatenate(steps, axis=1)
    with torch.no_grad():
        ref = h.module(torch.from_numpy(ids), torch.ones_like(torch.from_numpy(ids))).numpy()
    assert np.abs(got - ref).max() < 1e-4 and (got.argmax(-1) == ref.argmax(-1)).all()
    assert len(set(got.argmax(-1)[0].tolist())) > 3
    again = decoder.generate(prompt, 12)[0]  # reset() reuses the buffers
    assert again.tolist() == bound.tolist()
    with pytest.raises(BadInputError, match="40 tokens exceed the KV cache of 32 tokens"):
        decoder.reset()
        decoder.forward(np.zeros((1, 40), dtype=np.int64))


def test_io_bound_decode_on_the_traced_graph_binds_presents(tmp_path):
    h = _packed(32)
    out = export_causal_lm(h, tmp_path / "traced", graph="traced", accuracy_level=None)
    sess = lm_session(out / "model.onnx")
    prompt = h.make_inputs(1, sequence=5)["input_ids"]
    decoder = KVCacheDecoder(sess, max_length=32)
    assert not decoder.shared
    assert decoder.generate(prompt, 6)[0].tolist() == generate_greedy(sess, prompt, 6).tolist()


def test_export_writes_the_fused_graph_by_default_and_checks_it(tmp_path):
    h = _packed(32)
    out = export_causal_lm(h, tmp_path / "fused")
    man = json.loads((out / "manifest.json").read_text())
    assert man["config"]["graph"] == "fused" and man["config"]["block_size"] == [32]
    assert man["metrics"]["parity"]["passed"] and man["metrics"]["parity_int8_compute"]["passed"]
    assert man["metrics"]["parity"]["io_binding"]["kv_cache"] == "in place (shared buffer)"


def test_fused_graph_bad_input_messages():
    with pytest.raises(BadInputError, match=r"MatMulNBits block size 48 is not one of \(16, 32, 64, 128, 256\)"):
        FusedGraphConfig(block_size=48)
    h = _packed(32)
    with pytest.raises(BadInputError, match=r"block size 64 does not divide the quantization group 32 of a "
                                            r"64-input layer \(choose one of \[16, 32\]\)"):
        build_fused_decoder(h.module.model, FusedGraphConfig(block_size=64))
    gelu = tiny_llama(hidden_act="gelu")
    assert supports_fused_graph(gelu.module.model) == (False, "activation 'gelu' is not SiLU")
    with pytest.raises(BadInputError, match="--graph fused is not available for tiny-llama: activation 'gelu' is "
                                            r"not SiLU \(use --graph traced\)"):
        export_causal_lm(gelu, "unused", graph="fused")
    with pytest.raises(BadInputError, match="unknown causal-LM graph 'fast'"):
        export_causal_lm(h, "unused", graph="fast")


@pytest.fixture(scope="module")
def fused_session(tmp_path_factory):
    h = _packed(32)
    path = tmp_path_factory.mktemp("gen") / "model.onnx"
    onnx.save(build_fused_decoder(h.module.model, FusedGraphConfig()), str(path))
    return lm_session(path)


def test_generation_metrics_have_their_keys_and_counts(fused_session):
    cfg = GenerationConfig(prompt_lengths=(8, 16), contexts=(8, 24), new_tokens=4, warmup_ms=0, duration_s=0,
                           iterations=3, decode_runs=2)
    gen = measure_generation(KVCacheDecoder(fused_session, cfg.max_length), cfg)
    assert cfg.max_length == 28
    assert set(gen["time_to_first_token_ms"]) == {"8", "16"} and set(gen["decode"]) == {"8", "24"}
    ttft = gen["time_to_first_token_ms"]["16"]
    assert ttft["wall_ms"]["count"] == 3 and ttft["cpu_ms"]["count"] == 3
    assert ttft["wall_ms"]["p50"] <= ttft["wall_ms"]["p99"] <= ttft["wall_ms"]["max"]
    dec = gen["decode"]["24"]
    assert dec["runs"] == 2 and dec["step"]["wall_ms"]["count"] == 8 and dec["new_tokens"] == 4
    assert dec["tokens_per_s"] > 0 and len(dec["tokens_per_s_runs"]) == 2
    assert gen["kv_cache"] == "in place (shared buffer)"
    assert gen["kv_cache_mb"] == pytest.approx(2 * 2 * 2 * 28 * 16 * 4 / 2**20, abs=0.01)
    assert gen["peak_memory_mb"] > 0


def _profile_with(gen: dict | None) -> ProfileResult:
    stats = LatencyStats.from_samples([10.0, 11.0, 12.0])
    return ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={}, latency_ms=stats,
                         throughput_per_s=90.0, generation=gen)


GEN = {"decode": {"128": {"tokens_per_s": 80.0}, "1024": {"tokens_per_s": 60.0}},
       "time_to_first_token_ms": {"128": {"wall_ms": {"p50": 300.0, "p99": 320.0}},
                                  "512": {"wall_ms": {"p50": 1300.0, "p99": 1400.0}}}}


def test_check_generation_gates_the_slowest_context_and_the_longest_prompt(tmp_path):
    v = check_generation(_profile_with(GEN), min_tokens_per_s=50)
    assert v.passed and v.context == "1024" and v.tokens_per_s == 60.0
    v = check_generation(_profile_with(GEN), min_tokens_per_s=70)
    assert not v.passed and v.message() == "FAIL: decode 60.0 tokens/s at context 1024 vs minimum 70 tokens/s"
    v = check_generation(_profile_with(GEN), max_ttft_ms=1350, percentile="p99")
    assert not v.passed and v.prompt_length == "512" and v.ttft_ms == 1400.0
    assert check_generation(_profile_with(GEN), max_ttft_ms=1350, percentile="p50").passed
    with pytest.raises(BadInputError, match="the profile has no generation metrics"):
        check_generation(_profile_with(None), min_tokens_per_s=1)
    with pytest.raises(BadInputError, match="minimum tokens/s must be a positive number, got -1"):
        check_generation(_profile_with(GEN), min_tokens_per_s=-1)
    # the CLI: exit 0 / 1 / 2, and the profile JSON keeps its old keys
    path = tmp_path / "p.json"
    _profile_with(GEN).save(path)
    data = json.loads(path.read_text())
    assert data["generation"] == GEN and data["latency_ms"]["p50"] == 11.0
    run = lambda *a: CliRunner().invoke(cli, [str(x) for x in a])  # noqa: E731
    r = run("check", path, "--min-tokens-per-s", 50, "--budget-ms", 20)
    assert r.exit_code == 0 and "PASS: decode 60.0 tokens/s at context 1024" in r.output
    r = run("check", path, "--min-tokens-per-s", 65)
    assert r.exit_code == 1 and "FAIL: decode 60.0 tokens/s" in r.output
    r = run("check", path)
    assert r.exit_code == 2 and "error: give a budget: --budget-ms, --min-tokens-per-s or --max-ttft-ms" in r.output


def test_profile_json_without_generation_still_loads(tmp_path):
    old = _profile_with(None).to_dict()
    del old["generation"]  # a profile written before generation metrics existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert ProfileResult.load(path).generation is None


@pytest.mark.parametrize("values,match", [
    ({"new_tokens": 0}, "new tokens must be >= 1, got 0"),
    ({"contexts": ()}, r"contexts must be whole numbers >= 1, got \(\)"),
    ({"prompt_lengths": (0,)}, r"prompt lengths must be whole numbers >= 1, got \(0,\)"),
    ({"new_tokens": 10**9}, "new tokens must be at most 1048576, got 1000000000"),  # hours of decode steps
    ({"contexts": (128, 2**21)}, "contexts must be at most 1048576 tokens, got 2097152"),
])
def test_generation_config_rejects_bad_values(values, match):
    with pytest.raises(BadInputError, match=match):
        GenerationConfig(**values)


def test_the_kv_cache_is_sized_against_the_memory_before_it_is_allocated(fused_session, monkeypatch):
    from edgekit import limits

    monkeypatch.setattr(limits, "available_memory", lambda: 64 * 2**20)
    assert KVCacheDecoder(fused_session, 32).shared  # a few KiB
    with pytest.raises(BadInputError, match=r"^the KV cache of 1048576 tokens at batch 1 needs .*; edgekit lets it "
                                            r"take at most a quarter of the 64 MiB of memory available here; lower "
                                            r"--contexts, --prompt-lengths or --new-tokens$"):
        KVCacheDecoder(fused_session, 2**20)


def test_cli_profile_reports_generation_metrics_of_a_causal_lm_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    h = _packed(32)
    export_causal_lm(h, tmp_path / "onnx")
    run = lambda *a: CliRunner().invoke(cli, [str(x) for x in a])  # noqa: E731
    assert run("build", "onnx", "--target", "cpu", "--threads", "1", "-o", "eng").exit_code == 0
    r = run("profile", "eng", "--duration-s", 0, "--warmup-ms", 0, "--iterations", 2, "--no-nodes",
            "--prompt-lengths", "8,16", "--contexts", "8", "--new-tokens", 3, "--json", "p.json")
    assert r.exit_code == 0, r.output
    prof = json.loads((tmp_path / "p.json").read_text())
    assert prof["latency_ms"]["count"] >= 2  # the decode step, as before
    assert set(prof["generation"]["time_to_first_token_ms"]) == {"8", "16"}
    assert prof["generation"]["decode"]["8"]["step"]["wall_ms"]["count"] == 6  # 2 runs x 3 tokens
    assert "time to first token, 16 prompt tokens" in r.output
    r = run("profile", "eng", "--prompt-lengths", "8,x")
    assert r.exit_code == 2 and "error: --prompt-lengths takes comma-separated whole numbers, got '8,x'" in r.output
    # the model declares 128 positions (recorded at export): lengths beyond are refused before any timing,
    # the defaults are cut to them
    assert json.loads((tmp_path / "onnx" / "manifest.json").read_text())["model"]["context"] == {
        "max_position_embeddings": 128, "tokens": 128, "rope_type": "default", "original": 128, "thresholds": []}
    r = run("profile", "eng", "--contexts", "8,1024", "--json", "x.json")
    assert r.exit_code == 2 and r.output.strip() == (
        "error: --contexts 8,1024 with 32 new tokens runs 1056 tokens, beyond the 128 positions eng's model declares; "
        "choose contexts up to 96 (or fewer new tokens)")
    assert not (tmp_path / "x.json").exists()
    r = run("profile", "eng", "--duration-s", 0, "--warmup-ms", 0, "--iterations", 2, "--no-nodes", "--json", "d.json")
    assert r.exit_code == 0, r.output
    prof = json.loads((tmp_path / "d.json").read_text())
    settings = prof["generation"]["settings"]
    assert (settings["prompt_lengths"], settings["contexts"], settings["new_tokens"]) == ([128], [96], 32)
    assert set(prof["generation"]["decode"]) == {"96"} and set(prof["generation"]["time_to_first_token_ms"]) == {"128"}
    assert ("the default lengths are cut to the 128 positions eng's model declares: prompts 128, contexts 96, 32 new "
            "tokens") in prof["warnings"]
    assert ("latency_ms times a decode step after a 128-token past, beyond the 128 positions the model declares"
            in prof["warnings"])


@pytest.mark.parametrize("given,tokens,want", [
    ({}, None, ((128, 512), (128, 1024), 128, [])),
    ({}, 4096, ((128, 512), (128, 1024), 128, [])),
    ({}, 64, ((64,), (48,), 16, ["the default lengths are cut to the 64 positions m declares: prompts 64, "
                                 "contexts 48, 16 new tokens"])),
    ({"contexts": (8, 16), "new_tokens": 4}, 64, ((64,), (8, 16), 4, [
        "the default lengths are cut to the 64 positions m declares: prompts 64, contexts 8,16, 4 new tokens"])),
    ({"prompt_lengths": (64,), "contexts": (32,), "new_tokens": 32}, 64, ((64,), (32,), 32, [])),
])
def test_generation_lengths_fit_the_declared_context(given, tokens, want):
    cfg, warnings = GenerationConfig(**given).within_context(tokens, "m")
    assert (cfg.prompt_lengths, cfg.contexts, cfg.new_tokens, warnings) == want
    assert cfg.max_length <= (tokens or 1 << 30)


@pytest.mark.parametrize("given,match", [
    ({"prompt_lengths": (65,)}, "--prompt-lengths 65 exceeds the 64 positions m declares; choose prompt lengths up "
                                "to 64"),
    ({"contexts": (60,)}, r"--contexts 60 with 16 new tokens runs 76 tokens, beyond the 64 positions m declares; "
                          r"choose contexts up to 48 \(or fewer new tokens\)"),
    ({"new_tokens": 64}, "--new-tokens 64 leaves no context within the 64 positions m declares; choose fewer than 64"),
])
def test_generation_lengths_beyond_the_declared_context_are_refused(given, match):
    with pytest.raises(BadInputError, match=match):
        GenerationConfig(**given).within_context(64, "m")
