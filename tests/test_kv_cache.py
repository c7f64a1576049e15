"""kv_cache.py: what a graph without the KV cache gets. (Prefill and decode through the cache on
real exported graphs: tests/export/test_decode.py.)"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from edgekit.errors import BadInputError
from edgekit.kv_cache import KV_CACHE_METADATA, KV_SHARED_BUFFER, KVCacheDecoder, is_causal_lm_session


def _relu_session(tmp_path):
    import onnxruntime as ort

    graph = helper.make_graph([helper.make_node("Relu", ["input_ids"], ["logits"])], "relu",
                              [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "relu.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString())
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_a_graph_without_past_inputs_is_no_causal_lm(tmp_path):
    session = _relu_session(tmp_path)
    assert not is_causal_lm_session(session)
    with pytest.raises(BadInputError, match=r"^the session has no past_key_values inputs: not a causal LM "
                                            r"exported with its KV cache$"):
        KVCacheDecoder(session, max_length=8)
    assert np.array_equal(session.run(None, {"input_ids": np.array([[-1, 2, -3, 4]], np.float32)})[0],
                          [[0, 2, 0, 4]])


def test_the_metadata_names_are_the_exported_ones():
    assert (KV_CACHE_METADATA, KV_SHARED_BUFFER) == ("edgekit.kv_cache", "shared-buffer")
