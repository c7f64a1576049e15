"""A machine's GPU, SM and TensorRT version (runtimes/tensorrt/device.py), parsed from the probe
that runs here, over SSH or in a build bundle."""
from __future__ import annotations

from edgekit.runtimes.tensorrt.device import parse_probe


def test_probe_parsing():
    info = parse_probe("gpu=NVIDIA H100 80GB HBM3\ncompute_cap=9.0\nboard=\ntrtexec=/usr/bin/trtexec\n"
                             "trtexec_banner=TensorRT v100300\npy_tensorrt=\n")
    assert (info.gpu, info.sm, info.tensorrt_version, info.trtexec) == ("NVIDIA H100 80GB HBM3", "sm_90", "10.3.0",
                                                                       "/usr/bin/trtexec")
    orin = parse_probe("gpu=\ncompute_cap=\nboard=NVIDIA Jetson AGX Orin Developer Kit\ntrtexec_banner=TensorRT v8602\n")
    assert (orin.sm, orin.tensorrt_version) == ("sm_87", "8.6.2")
    assert parse_probe("").sm is None
