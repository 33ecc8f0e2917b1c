"""A tiny Llama-like decoder with a KV cache, built with onnx.helper, for the LLM tests.

Same I/O contract as the bench's SmolLM2 export (``bench/exporters/smollm2.py``):

    inputs   input_ids                  int64   [batch, sequence]
             attention_mask             int64   [batch, total_sequence]
             past_key_values.{i}.key    float32 [batch, kv_heads, past_sequence, head_dim]
             past_key_values.{i}.value  (same)
    outputs  logits                     float32 [batch, sequence, vocab]
             present.{i}.key / .value   float32 [batch, kv_heads, total_sequence, head_dim]

and the same pieces an exporter writes for a Llama: positions from the attention mask
(``CumSum - 1``, clamped, the last ``sequence`` of them), rotary embeddings, an additive
mask made of a causal ``Range`` comparison and the padding mask times float32's lowest
value, RMSNorm as Pow/ReduceMean/Sqrt/Div, grouped-query attention (each KV head serves
``heads / kv_heads`` query heads through Expand/Reshape), a SiLU-gated MLP and an untied
``lm_head`` MatMul (or, with ``tied=True``, ``MatMul(h, Transpose(embed))`` on the one
embedding table). Every weight is a seeded normal scaled by ``1/sqrt(fan_in)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["DataFile", "DecoderConfig", "decoder_feeds", "greedy_decode", "tiny_decoder"]


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5
    tied: bool = False
    opset: int = 17

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{k}" for i in range(self.layers) for k in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{k}" for i in range(self.layers) for k in ("key", "value")]


class DataFile:
    """Where ``tiny_decoder(..., data=)`` puts its large weights: one external data file,
    each weight written through a ``np.memmap`` of its span (4 KiB aligned) as it is made,
    so that no more than one weight is in memory. With ``dense_rows``, a weight ``[K, N]``
    is real only in its first ``dense_rows`` rows and zero below: those rows are the only
    bytes written, the rest of the file is a hole (a sparse file of any size costs little
    disk and time)."""

    def __init__(self, path: Path, *, min_bytes: int = 1 << 16, dense_rows: int | None = None):
        self.path = path
        self.min_bytes = min_bytes
        self.dense_rows = dense_rows
        self.offset = 0
        path.write_bytes(b"")

    def rows(self, rows: int) -> int:
        return rows if self.dense_rows is None else min(rows, self.dense_rows)

    def tensor(self, name: str, value: np.ndarray, shape: tuple[int, ...]) -> onnx.TensorProto:
        """``value`` (the first rows of a float32 weight of ``shape``) as an external tensor."""
        nbytes = 4 * int(np.prod(shape))
        if value.size:
            span = np.memmap(self.path, np.float32, "r+", self.offset, value.shape)
            span[...] = value
            span.flush()
            del span
        tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, entry in (
            ("location", self.path.name),
            ("offset", self.offset),
            ("length", nbytes),
        ):
            item = tensor.external_data.add()
            item.key, item.value = key, str(entry)
        self.offset = -(-(self.offset + nbytes) // 4096) * 4096
        return tensor

    def close(self) -> None:
        """Set the file's size (the sparse tail of the last weight included)."""
        with open(self.path, "r+b") as f:
            f.truncate(max(self.offset, f.seek(0, 2)))


class _Builder:
    def __init__(self, cfg: DecoderConfig, seed: int, data: DataFile | None = None) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0
        self.data = data

    def ops(self, op_type: str, inputs: list[str], n_out: int, **attrs: object) -> list[str]:
        self.count += 1
        outs = [f"{op_type.lower()}_{self.count}_{k}" for k in range(n_out)]
        self.nodes.append(
            helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self.count}", **attrs)
        )
        return outs

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        return self.ops(op_type, inputs, 1, **attrs)[0]

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, rows: int, cols: int, scale: float | None = None) -> str:
        scale = 1.0 / np.sqrt(rows) if scale is None else scale
        if self.data is not None and 4 * rows * cols >= self.data.min_bytes:
            real = self.data.rows(rows)
            w = (self.rng.standard_normal((real, cols)) * scale).astype(np.float32)
            self.inits.append(self.data.tensor(name, w, (rows, cols)))
            return name
        w = self.rng.standard_normal((rows, cols)) * scale
        return self.const(name, w.astype(np.float32))

    def rms_norm(self, x: str, name: str) -> str:
        gain = 1.0 + 0.1 * self.rng.standard_normal(self.cfg.hidden)
        w = self.const(name, gain.astype(np.float32))
        var = self.op("ReduceMean", [self.op("Pow", [x, "two"])], axes=[-1], keepdims=1)
        root = self.op("Sqrt", [self.op("Add", [var, "eps"])])
        return self.op("Mul", [self.op("Div", [x, root]), w])

    def heads(self, x: str, count: int) -> str:
        """[B, S, count*hd] -> [B, count, S, hd]."""
        shape = self.const(
            f"shape_heads_{count}_{self.count}",
            np.array([0, 0, count, self.cfg.head_dim], np.int64),
        )
        return self.op("Transpose", [self.op("Reshape", [x, shape])], perm=[0, 2, 1, 3])

    def rope(self, x: str, cos: str, sin: str) -> str:
        first, second = self.ops("Split", [x, "halves"], 2, axis=-1)
        rotated = self.op("Concat", [self.op("Neg", [second]), first], axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rotated, sin])])

    def repeat_kv(self, x: str) -> str:
        """[B, kv, T, hd] -> [B, heads, T, hd] (each KV head serves heads/kv query heads)."""
        cfg = self.cfg
        group = cfg.heads // cfg.kv_heads
        if group == 1:
            return x
        grown = self.op(
            "Expand",
            [
                self.op("Unsqueeze", [x, "axis2"]),
                self.const(f"expand_{self.count}", np.array([1, 1, group, 1, 1], np.int64)),
            ],
        )
        shape = self.const(
            f"shape_rep_{self.count}", np.array([0, cfg.heads, -1, cfg.head_dim], np.int64)
        )
        return self.op("Reshape", [grown, shape])


def _positions_and_mask(b: _Builder) -> tuple[str, str, str]:
    """(cos, sin) [B, 1, S, hd] from the mask's positions, and the additive mask [B,1,S,T]."""
    cfg = b.cfg
    seq = b.op("Shape", ["input_ids"], start=1, end=2)
    total = b.op("Shape", ["attention_mask"], start=1, end=2)
    past = b.op("Sub", [total, seq])
    counted = b.op("Sub", [b.op("CumSum", ["attention_mask", "one_axis"]), "one_i64"])
    positions = b.op("Slice", [b.op("Max", [counted, "zero_i64"]), past, total, "one_axis"])
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    b.const("inv_freq", inv_freq.astype(np.float32))
    angles = b.op(
        "Mul",
        [
            b.op("Unsqueeze", [b.op("Cast", [positions], to=TensorProto.FLOAT), "axis_last"]),
            "inv_freq",
        ],
    )
    both = b.op("Unsqueeze", [b.op("Concat", [angles, angles], axis=-1), "one_axis"])
    cos, sin = b.op("Cos", [both]), b.op("Sin", [both])
    scalar = "scalar_shape"
    query = b.op(
        "Range",
        [b.op("Reshape", [past, scalar]), b.op("Reshape", [total, scalar]), "one_i64_scalar"],
    )
    key = b.op("Range", ["zero_i64_scalar", b.op("Reshape", [total, scalar]), "one_i64_scalar"])
    causal = b.op(
        "LessOrEqual",
        [b.op("Unsqueeze", [key, "zero_axis"]), b.op("Unsqueeze", [query, "one_axis"])],
    )
    padding = b.op("Unsqueeze", [b.op("Cast", ["attention_mask"], to=TensorProto.BOOL), "axes_1_2"])
    allowed = b.op("Cast", [b.op("And", [causal, padding])], to=TensorProto.FLOAT)
    bias = b.op("Mul", [b.op("Sub", ["one_f32", allowed]), "lowest_f32"])
    return cos, sin, bias


def _layer(b: _Builder, x: str, i: int, cos: str, sin: str, bias: str) -> str:
    cfg = b.cfg
    hd, kv = cfg.head_dim, cfg.kv_heads
    h = b.rms_norm(x, f"layers.{i}.input_norm.weight")
    q = b.rope(
        b.heads(
            b.op("MatMul", [h, b.weight(f"layers.{i}.q_proj", cfg.hidden, cfg.heads * hd)]),
            cfg.heads,
        ),
        cos,
        sin,
    )
    k = b.rope(
        b.heads(b.op("MatMul", [h, b.weight(f"layers.{i}.k_proj", cfg.hidden, kv * hd)]), kv),
        cos,
        sin,
    )
    v = b.heads(b.op("MatMul", [h, b.weight(f"layers.{i}.v_proj", cfg.hidden, kv * hd)]), kv)
    keys = f"present.{i}.key"
    values = f"present.{i}.value"
    b.nodes.append(
        helper.make_node(
            "Concat", [f"past_key_values.{i}.key", k], [keys], axis=2, name=f"concat_key_{i}"
        )
    )
    b.nodes.append(
        helper.make_node(
            "Concat", [f"past_key_values.{i}.value", v], [values], axis=2, name=f"concat_value_{i}"
        )
    )
    scores = b.op("MatMul", [q, b.op("Transpose", [b.repeat_kv(keys)], perm=[0, 1, 3, 2])])
    scores = b.op("Add", [b.op("Mul", [scores, "attn_scale"]), bias])
    attended = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), b.repeat_kv(values)])
    merged = b.op("Reshape", [b.op("Transpose", [attended], perm=[0, 2, 1, 3]), "merge_shape"])
    x = b.op(
        "Add",
        [x, b.op("MatMul", [merged, b.weight(f"layers.{i}.o_proj", cfg.heads * hd, cfg.hidden)])],
    )
    h = b.rms_norm(x, f"layers.{i}.post_norm.weight")
    gate = b.op("MatMul", [h, b.weight(f"layers.{i}.gate_proj", cfg.hidden, cfg.intermediate)])
    up = b.op("MatMul", [h, b.weight(f"layers.{i}.up_proj", cfg.hidden, cfg.intermediate)])
    act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
    down = b.weight(f"layers.{i}.down_proj", cfg.intermediate, cfg.hidden)
    return b.op("Add", [x, b.op("MatMul", [act, down])])


def _shared_constants(b: _Builder) -> None:
    cfg = b.cfg
    for name, value in {
        "two": np.float32(2.0),
        "eps": np.float32(cfg.eps),
        "one_f32": np.float32(1.0),
        "lowest_f32": np.float32(np.finfo(np.float32).min),
        "attn_scale": np.float32(1.0 / np.sqrt(cfg.head_dim)),
        "one_i64": np.array([1], np.int64),
        "zero_i64": np.array([0], np.int64),
        "one_i64_scalar": np.int64(1),
        "zero_i64_scalar": np.int64(0),
        "one_axis": np.array([1], np.int64),
        "zero_axis": np.array([0], np.int64),
        "axis2": np.array([2], np.int64),
        "axis_last": np.array([-1], np.int64),
        "axes_1_2": np.array([1, 2], np.int64),
        "scalar_shape": np.array([], np.int64),
        "halves": np.array([cfg.head_dim // 2] * 2, np.int64),
        "merge_shape": np.array([0, 0, cfg.hidden], np.int64),
    }.items():
        b.const(name, np.asarray(value))


def tiny_decoder(
    cfg: DecoderConfig | None = None, *, seed: int = 0, data: DataFile | None = None
) -> onnx.ModelProto:
    """The decoder as an ONNX model (opset ``cfg.opset``, IR version 8), checked; with
    ``data``, its large weights are in that external data file (save the proto beside it,
    without ``save_as_external_data``), and it is not checked here."""
    cfg = cfg or DecoderConfig()
    b = _Builder(cfg, seed, data)
    _shared_constants(b)
    embed = b.weight("embed_tokens.weight", cfg.vocab, cfg.hidden, scale=0.5)
    x = b.op("Gather", [embed, "input_ids"], axis=0)
    cos, sin, bias = _positions_and_mask(b)
    for i in range(cfg.layers):
        x = _layer(b, x, i, cos, sin, bias)
    h = b.rms_norm(x, "final_norm.weight")
    head = (
        b.op("Transpose", [embed], perm=[1, 0])
        if cfg.tied
        else b.weight("lm_head.weight", cfg.hidden, cfg.vocab)
    )
    b.nodes.append(helper.make_node("MatMul", [h, head], ["logits"], name="lm_head"))
    kv_shape = lambda length: ["batch", cfg.kv_heads, length, cfg.head_dim]  # noqa: E731
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info(
            "attention_mask", TensorProto.INT64, ["batch", "total_sequence"]
        ),
    ]
    inputs += [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape("past_sequence"))
        for n in cfg.past_names()
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", cfg.vocab])
    ]
    outputs += [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape("total_sequence"))
        for n in cfg.present_names()
    ]
    graph = helper.make_graph(b.nodes, "tiny_decoder", inputs, outputs, b.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", cfg.opset)],
        ir_version=8,
        producer_name="tests.llm_models",
    )
    if data is None:
        onnx.checker.check_model(model, full_check=True)
    else:
        data.close()  # check the saved file: onnx.checker.check_model(path)
    return model


def decoder_feeds(
    cfg: DecoderConfig,
    *,
    batch: int = 2,
    sequence: int = 3,
    past: int = 5,
    padding: int = 0,
    seed: int = 1,
) -> dict[str, np.ndarray]:
    """Seeded feeds: random ids, a past of ``past`` positions (seeded normal keys/values,
    or empty arrays when 0), and a mask of ones whose first ``padding`` positions of the
    last row are 0 (left padding)."""
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": rng.integers(0, cfg.vocab, (batch, sequence), dtype=np.int64),
        "attention_mask": np.ones((batch, past + sequence), np.int64),
    }
    feeds["attention_mask"][-1, :padding] = 0
    for name in cfg.past_names():
        shape = (batch, cfg.kv_heads, past, cfg.head_dim)
        feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def greedy_decode(run, cfg: DecoderConfig, prompt: np.ndarray, steps: int) -> list[int]:
    """Greedy tokens from ``run(feeds) -> {name: array}`` with the KV cache, batch 1; the
    first call feeds an empty past (past dim 0)."""
    feeds = {
        "input_ids": prompt[None].astype(np.int64),
        "attention_mask": np.ones((1, len(prompt)), np.int64),
    }
    feeds.update(
        {n: np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32) for n in cfg.past_names()}
    )
    tokens: list[int] = []
    for _ in range(steps):
        out = run(feeds)
        tokens.append(int(np.argmax(out["logits"][0, -1])))
        mask = np.ones((1, feeds["attention_mask"].shape[1] + 1), np.int64)
        feeds = {"input_ids": np.array([[tokens[-1]]], np.int64), "attention_mask": mask}
        feeds.update(
            {p: out[q] for p, q in zip(cfg.past_names(), cfg.present_names(), strict=True)}
        )
    return tokens
