"""Architectures of models with published device latencies, in plain torch (random weights:
an estimate needs the graph, not the weights): ResNet-50 v1.5, BERT encoders (base, large),
YOLO11 n/s/m/l/x as Ultralytics defines them (yolo11.yaml: C3k2, SPPF, C2PSA, Detect with
DFL decoding) and MLPerf's RetinaNet (ResNeXt50-32x4d FPN, 800x800, 264 OpenImages classes,
as torchvision builds it). Used by bench_estimate_published.py and the estimate tests.
"""
from __future__ import annotations

import math

import torch
from torch import nn


# --- ResNet-50 v1.5 (stride on the 3x3 convolution, as MLPerf's reference) -------------------------
class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.c1, self.b1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.c2, self.b2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.c3, self.b3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        return torch.relu(self.b3(self.c3(y)) + self.down(x))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(_Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 224, 224) -> (B, 1000)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


# --- BERT encoder (post-LN, GELU), with the SQuAD span head of MLPerf's BERT-99 ---------------------
class _BertLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.out(y))
        return self.ln2(x + self.down(nn.functional.gelu(self.up(x))))


class Bert(nn.Module):
    def __init__(self, layers: int = 24, d: int = 1024, heads: int = 16, ffn: int = 4096, vocab: int = 30522) -> None:
        super().__init__()
        self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(512, d), nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(_BertLayer(d, heads, ffn) for _ in range(layers))
        self.qa = nn.Linear(d, 2)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.ln(self.tok(input_ids) + self.pos(torch.arange(s)) + self.typ(token_type_ids))
        bias = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        return self.qa(x)  # (B, S, 2): start and end logits


# --- YOLO11 (Ultralytics yolo11.yaml) ----------------------------------------------------------------
def _div8(x: float) -> int:
    return int(math.ceil(x / 8) * 8)


class Conv(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1, act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c1: int, c2: int, shortcut: bool = True, k: tuple[int, int] = (3, 3), e: float = 0.5) -> None:
        super().__init__()
        c = int(c2 * e)
        self.cv1, self.cv2 = Conv(c1, c, k[0]), Conv(c, c2, k[1])
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3k(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 2, shortcut: bool = True) -> None:
        super().__init__()
        c = int(c2 * 0.5)
        self.cv1, self.cv2, self.cv3 = Conv(c1, c, 1), Conv(c1, c, 1), Conv(2 * c, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c, c, shortcut, (3, 3), 1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class C3k2(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1, c3k: bool = False, e: float = 0.5, shortcut: bool = True) -> None:
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(C3k(self.c, self.c, 2, shortcut) if c3k else Bottleneck(self.c, self.c, shortcut)
                               for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c = c1 // 2
        self.cv1, self.cv2 = Conv(c1, c, 1), Conv(c * 4, c2, 1)
        self.m = nn.MaxPool2d(k, 1, k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        y.extend(self.m(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class PSAAttention(nn.Module):
    def __init__(self, dim: int, heads: int, attn_ratio: float = 0.5) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.kd = int(self.hd * attn_ratio)
        self.scale = self.kd ** -0.5
        self.qkv = Conv(dim, dim + 2 * self.kd * heads, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, 1, g=dim, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).view(b, self.heads, 2 * self.kd + self.hd, h * w).split([self.kd, self.kd, self.hd], 2)
        att = ((q.transpose(-2, -1) @ k) * self.scale).softmax(-1)
        y = (v @ att.transpose(-2, -1)).view(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
        return self.proj(y)


class C2PSA(nn.Module):
    def __init__(self, c1: int, n: int = 1) -> None:
        super().__init__()
        self.c = c1 // 2
        self.cv1, self.cv2 = Conv(c1, 2 * self.c, 1), Conv(2 * self.c, c1, 1)
        self.attn = nn.ModuleList(PSAAttention(self.c, self.c // 64) for _ in range(n))
        self.ffn = nn.ModuleList(nn.Sequential(Conv(self.c, 2 * self.c, 1), Conv(2 * self.c, self.c, 1, act=False))
                                 for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.cv1(x).split((self.c, self.c), 1)
        for attn, ffn in zip(self.attn, self.ffn):
            b = b + attn(b)
            b = b + ffn(b)
        return self.cv2(torch.cat((a, b), 1))


class Detect(nn.Module):
    def __init__(self, nc: int, ch: tuple[int, ...], reg_max: int = 16) -> None:
        super().__init__()
        self.nc, self.reg = nc, reg_max
        c2, c3 = max(16, ch[0] // 4, reg_max * 4), max(ch[0], min(nc, 100))
        self.box = nn.ModuleList(nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1))
                                 for x in ch)
        self.cls = nn.ModuleList(nn.Sequential(Conv(x, x, 3, g=x), Conv(x, c3, 1), Conv(c3, c3, 3, g=c3),
                                               Conv(c3, c3, 1), nn.Conv2d(c3, nc, 1)) for x in ch)
        self.dfl = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
        self.dfl.weight.data[:] = torch.arange(reg_max, dtype=torch.float).view(1, reg_max, 1, 1)

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        b = xs[0].shape[0]
        outs, anchors, strides = [], [], []
        for i, x in enumerate(xs):
            h, w = x.shape[2:]
            outs.append(torch.cat((self.box[i](x), self.cls[i](x)), 1).view(b, 4 * self.reg + self.nc, -1))
            sy, sx = torch.meshgrid(torch.arange(h, dtype=x.dtype) + 0.5, torch.arange(w, dtype=x.dtype) + 0.5,
                                    indexing="ij")
            anchors.append(torch.stack((sx, sy), -1).view(-1, 2))
            strides.append(torch.full((h * w, 1), 8.0 * 2 ** i, dtype=x.dtype))  # strides 8, 16, 32
        y = torch.cat(outs, 2)
        anchor = torch.cat(anchors).transpose(0, 1)
        stride = torch.cat(strides).transpose(0, 1)
        box, cls = y.split((4 * self.reg, self.nc), 1)
        a = box.shape[-1]
        dist = self.dfl(box.view(b, 4, self.reg, a).transpose(2, 1).softmax(1)).view(b, 4, a)
        lt, rb = dist.chunk(2, 1)
        x1y1, x2y2 = anchor - lt, anchor + rb
        xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1)
        return torch.cat((xywh * stride, cls.sigmoid()), 1)  # (B, 84, 8400)


class YOLO11(nn.Module):
    SCALES = {"n": (0.50, 0.25, 1024), "s": (0.50, 0.50, 1024), "m": (0.50, 1.00, 512), "l": (1.00, 1.00, 512),
              "x": (1.00, 1.50, 512)}

    def __init__(self, scale: str = "n", nc: int = 80) -> None:
        super().__init__()
        depth, width, max_ch = self.SCALES[scale]
        c3k_all = scale in "mlx"

        def ch(c: int) -> int:
            return _div8(min(c, max_ch) * width)

        def n(r: int) -> int:
            return max(round(r * depth), 1)

        self.b0, self.b1 = Conv(3, ch(64), 3, 2), Conv(ch(64), ch(128), 3, 2)
        self.b2 = C3k2(ch(128), ch(256), n(2), c3k_all, 0.25)
        self.b3 = Conv(ch(256), ch(256), 3, 2)
        self.b4 = C3k2(ch(256), ch(512), n(2), c3k_all, 0.25)
        self.b5 = Conv(ch(512), ch(512), 3, 2)
        self.b6 = C3k2(ch(512), ch(512), n(2), True)
        self.b7 = Conv(ch(512), ch(1024), 3, 2)
        self.b8 = C3k2(ch(1024), ch(1024), n(2), True)
        self.b9 = SPPF(ch(1024), ch(1024), 5)
        self.b10 = C2PSA(ch(1024), n(2))
        self.h13 = C3k2(ch(1024) + ch(512), ch(512), n(2), c3k_all)
        self.h16 = C3k2(ch(512) + ch(512), ch(256), n(2), c3k_all)
        self.h17 = Conv(ch(256), ch(256), 3, 2)
        self.h19 = C3k2(ch(256) + ch(512), ch(512), n(2), c3k_all)
        self.h20 = Conv(ch(512), ch(512), 3, 2)
        self.h22 = C3k2(ch(512) + ch(1024), ch(1024), n(2), True)
        self.detect = Detect(nc, (ch(256), ch(512), ch(1024)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 640, 640) -> (B, 84, 8400)
        up = nn.functional.interpolate
        p3 = self.b4(self.b3(self.b2(self.b1(self.b0(x)))))
        p4 = self.b6(self.b5(p3))
        p5 = self.b10(self.b9(self.b8(self.b7(p4))))
        h13 = self.h13(torch.cat((up(p5, scale_factor=2.0), p4), 1))
        h16 = self.h16(torch.cat((up(h13, scale_factor=2.0), p3), 1))
        h19 = self.h19(torch.cat((self.h17(h16), h13), 1))
        h22 = self.h22(torch.cat((self.h20(h19), p5), 1))
        return self.detect([h16, h19, h22])


# --- RetinaNet (MLPerf Inference: ResNeXt50-32x4d FPN, P3-P7, 9 anchors, 264 classes) -------------
class _XBlock(nn.Module):
    """ResNeXt bottleneck: 1x1, grouped 3x3 (32 groups of 4 per 64 planes), 1x1, stride on the 3x3."""

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        width, cout = planes * 2, planes * 4
        self.c1, self.b1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.c2, self.b2 = nn.Conv2d(width, width, 3, stride, 1, groups=32, bias=False), nn.BatchNorm2d(width)
        self.c3, self.b3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        return torch.relu(self.b3(self.c3(y)) + self.down(x))


class _Head(nn.Module):
    def __init__(self, out: int) -> None:
        super().__init__()
        self.tower = nn.Sequential(*(m for _ in range(4) for m in (nn.Conv2d(256, 256, 3, 1, 1), nn.ReLU())))
        self.out = nn.Conv2d(256, out, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.tower(x))


class RetinaNet(nn.Module):
    def __init__(self, classes: int = 264, anchors: int = 9) -> None:
        super().__init__()
        self.classes = classes
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for i in range(blocks):
                layers.append(_XBlock(cin, planes, stride if i == 0 else 1))
                cin = planes * 4
            stages.append(nn.Sequential(*layers))
        self.stages = nn.ModuleList(stages)
        self.inner = nn.ModuleList(nn.Conv2d(c, 256, 1) for c in (512, 1024, 2048))
        self.layer = nn.ModuleList(nn.Conv2d(256, 256, 3, 1, 1) for _ in range(3))
        self.p6, self.p7 = nn.Conv2d(256, 256, 3, 2, 1), nn.Conv2d(256, 256, 3, 2, 1)
        self.cls, self.box = _Head(anchors * classes), _Head(anchors * 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, 3, 800, 800)
        x = self.stem(x)
        feats = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i >= 1:
                feats.append(x)
        last = self.inner[2](feats[2])
        outs = [self.layer[2](last)]
        for i in (1, 0):
            last = self.inner[i](feats[i]) + nn.functional.interpolate(last, size=feats[i].shape[-2:], mode="nearest")
            outs.insert(0, self.layer[i](last))
        p6 = self.p6(outs[-1])
        outs += [p6, self.p7(torch.relu(p6))]
        b = x.shape[0]
        cls = torch.cat([self.cls(p).permute(0, 2, 3, 1).reshape(b, -1, self.classes) for p in outs], 1)
        box = torch.cat([self.box(p).permute(0, 2, 3, 1).reshape(b, -1, 4) for p in outs], 1)
        return cls, box  # (B, 120087, 264), (B, 120087, 4) at 800x800


def export(model: nn.Module, args: tuple[torch.Tensor, ...], names: list[str], path: str) -> str:
    """ONNX (opset 17, TorchScript exporter: plain ops, as TensorRT and ONNX Runtime take them)."""
    model.eval()
    with torch.no_grad():
        torch.onnx.export(model, args, path, input_names=names, opset_version=17, dynamo=False)
    return path


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
